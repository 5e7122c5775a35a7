"""Run by test_distributed.py under ``torchrun --nproc-per-node 4`` (gloo, CPU).

hybrid_mesh with islands: 4 nodes of 1 rank in 2 islands of 2 (``island_nodes=2``) must make
the mesh of 2 nodes x 2 ranks (the same ranks shard, the same ranks replicate: the trainer's
``--island-nodes`` layout test), and island sizes that do not divide the nodes are refused in one
line. Rank 0 prints what it checked.
"""

import torch.distributed as dist

import flexdemo


def groups(mesh):
    return (tuple(dist.get_process_group_ranks(mesh["shard"].get_group())),
            tuple(dist.get_process_group_ranks(mesh["replicate"].get_group())))


def main():
    dist.init_process_group("gloo")
    me = dist.get_rank()
    islands = flexdemo.hybrid_mesh(ranks_per_node=1, device_type="cpu", island_nodes=2)
    nodes = flexdemo.hybrid_mesh(ranks_per_node=2, device_type="cpu")
    assert tuple(islands.mesh.shape) == (2, 2), islands.mesh
    assert groups(islands) == groups(nodes), (groups(islands), groups(nodes))
    assert groups(islands)[0] == ((0, 1) if me < 2 else (2, 3)), groups(islands)
    for bad in (3, 0):
        try:
            flexdemo.hybrid_mesh(ranks_per_node=1, device_type="cpu", island_nodes=bad)
            raise AssertionError("island_nodes {} accepted".format(bad))
        except ValueError as e:
            assert "island_nodes {}; it must be >= 1 and divide the 4 nodes".format(bad) in str(e)
    if me == 0:
        print("islands: 2 islands x 2 nodes x 1 rank mesh the ranks as 2 nodes x 2 ranks:",
              groups(islands))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
