"""flexdemo.project: its sizes against closed-form counts, its costs against the collectives'
textbook formulas, its crossover against a search of every node count, and its bad input."""

import math
import subprocess
import sys

import pytest

from flexdemo import project


def test_payload_of_a_parameter_count_is_the_wire_formats_closed_form():
    # N parameters as one [ceil(N/4096) * 64, 64] tensor: ceil(N/4096) chunks of 64 x 64; bf16
    # entries are a 2-byte index and a 2-byte value, no scale; one 36-byte header.
    n = 1_000_000
    s = project.sizes(project.model_shapes(None, n), 4, 64, 32, "bf16")
    chunks = math.ceil(n / 4096)
    assert s.params == chunks * 4096
    assert s.dense_bytes == 4 * chunks * 4096
    assert s.payload_bytes == 36 + chunks * 32 * (2 + 2)


def test_gpt_micro_has_the_trainers_parameters():
    # flexdemo train --model gpt-micro: 4,273,664 parameters (its dense exchange, 2 nodes:
    # 34,189,312 bytes a step = 2 nodes x 4 bytes x parameters, docs/results/loss-parity.md)
    s = project.sizes(project.model_shapes("gpt-micro", None), 4, 64, 32, "bf16")
    assert 2 * s.dense_bytes == 34_189_312


def test_exchange_costs_are_the_collectives_formulas():
    s = project.Sizes(params=1000, dense_bytes=4000, payload_bytes=100)
    for n in (2, 3, 8, 1024):
        assert project.exchange_cost("allreduce-ring", n, s, 1) == (2 * (n - 1) / n * 4000,
                                                                     2 * (n - 1))
        assert project.exchange_cost("allgather", n, s, 1) == ((n - 1) * 100, n - 1)
        assert project.exchange_cost("owner", n, s, 1)[0] <= 2 * 100  # two payloads at any n
        assert project.exchange_cost("local", n, s, 10)[0] == pytest.approx((n - 1) * 100 / 10)
    assert project.exchange_cost("allreduce-tree", 1024, s, 1) == (8000, 20)
    assert project.exchange_cost("allgather", 1, s, 1) == (0.0, 0.0)


def test_crossover_is_the_first_node_count_where_the_allgather_is_slower():
    s = project.Sizes(params=1000, dense_bytes=4000, payload_bytes=100)
    link = project.Link(rate_bytes_per_s=1e6, latency_s=1e-5)
    for overlap in (False, True):
        got = project.crossover("allgather", s, 1, link, 0.001, overlap, limit=4096)
        def slower(n):
            dense = min(project.step_seconds(d, n, s, 1, link, 0.001, overlap)
                        for d in project.DENSE)
            return project.step_seconds("allgather", n, s, 1, link, 0.001, overlap) > dense
        want = next(n for n in range(2, 4097) if slower(n))
        assert got == want
    # the owner exchange's bytes stay two payloads: never slower while latency is free; its
    # 2 (N-1) messages against the tree's 2 log2 N make it slower at last when it is not
    free = project.Link(rate_bytes_per_s=1e6, latency_s=0.0)
    assert project.crossover("owner", s, 1, free, 0.001, False, limit=4096) is None
    assert project.crossover("owner", s, 1, link, 0.001, False, limit=4096) is not None


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model", "--compute-ms", "10"], "--model 'no-such-model'"),
    (["--params", "100", "--compute-ms", "10"], "--params 100"),
    (["--params", "100000", "--nodes", "4,0"], "every value must be > 0"),
    (["--params", "100000", "--topk", "0"], "--topk 0"),
])
def test_bad_input_is_named_with_a_nonzero_exit(args, needle, capsys):
    try:
        code = project.main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code != 0
    assert needle in err
    assert out == ""


def test_table_names_every_exchange_and_the_crossovers(tmp_path):
    # the command itself, as a user runs it
    run = subprocess.run([sys.executable, "-m", "flexdemo.project", "--params", "124000000",
                          "--compute-ms", "120", "--nodes", "8,1024", "--rate-gbit", "1",
                          "--json", str(tmp_path / "p.json")],
                         capture_output=True, text=True, check=True)
    for word in ("allreduce-ring", "allreduce-tree", "allgather", "owner", "local-10",
                 "diloco-10", "Crossover", "| 1,024 |"):
        assert word in run.stdout
    assert (tmp_path / "p.json").stat().st_size > 0
