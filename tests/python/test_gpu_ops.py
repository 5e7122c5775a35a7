"""The engine on a GPU (the CUDA kernels) against the CPU's portable kernels (FLEXDEMO_ISA=portable:
the GPU's arithmetic on the CPU): residuals and updates bit for bit, every encoding,
sign-SGD and the bounded step (the RMS-capped one to rounding); and FlexDeMo training on the
GPU. Skips with one line where no GPU is visible. The checks run as a script in a process of
their own (the kernels' instruction set is chosen once per process):
``python tests/python/test_gpu_ops.py`` (scripts/gpu-check.sh runs it so), one line a check."""

import os
import subprocess
import sys

import torch

SHAPES = [(96, 64), (64,), (200, 48), (8, 3, 16)]
CHUNK, TOPK = 32, 12


def gpu_visible():
    import flexdemo.ops
    return torch.cuda.is_available() and flexdemo.ops.cuda_built()


def test_gpu_ops_equal_the_portable_cpu_kernels():
    import pytest
    if not gpu_visible():
        pytest.skip("no GPU visible (or a build without the CUDA kernels)")
    run = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True,
                         text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]


# ====== The checks (this file as a script) ======
def step_on(device, values, **options):
    """Two steps of the engine (one replica) from the same residual history and gradients."""
    import flexdemo
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]
    opt = flexdemo.DeMo(params, compression_chunk=CHUNK, compression_topk=TOPK, values=values,
                        lr=0.01, weight_decay=0.1, compression_decay=0.99, **options)
    residuals = [next(v for k, v in opt.state[p].items() if k.startswith("residual."))
                 for p in params]
    for r in residuals:
        r.copy_(torch.randn(r.shape, generator=g) * 1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        opt.step()
    return [r.cpu() for r in residuals], [p.detach().cpu() for p in params]


def same_as_portable_cpu(values, params_atol=0.0, **options):
    want = step_on(torch.device("cpu"), values, **options)
    got = step_on(torch.device("cuda"), values, **options)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])), "residuals differ"
    assert all(torch.allclose(a, b, rtol=0, atol=params_atol) if params_atol else torch.equal(a, b)
               for a, b in zip(got[1], want[1])), "parameters differ"


def trains_on_the_gpu():
    import flexdemo
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 1)).cuda()
    opt = flexdemo.FlexDeMo(model.parameters(), lr=3e-3, compression_chunk=32,
                            compression_topk=16)
    x = torch.randn(256, 64, device="cuda")
    y = x[:, :1] * 0.5
    first = None
    for _ in range(50):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.5 * first, (first, loss.item())


def main():
    os.environ["FLEXDEMO_ISA"] = "portable"  # before the kernels are first used
    from flexdemo import ops
    if not gpu_visible():
        print("gpu ops: SKIPPED (no GPU visible, or a build without the CUDA kernels)")
        return 0
    checks = [("values " + v, lambda v=v: same_as_portable_cpu(v)) for v in ops.VALUE_ENCODINGS]
    checks.append(("the bounded step (sign off, step_bound 1e-3)",
                   lambda: same_as_portable_cpu("fp8", sign=False, step_bound=1e-3)))
    # The RMS cap: the direction decoded on the GPU (bit for bit), its RMS reduced there in
    # another order than on the CPU, so the step agrees to rounding.
    checks.append(("the RMS-capped step (sign off, rms_cap 0.05)",
                   lambda: same_as_portable_cpu("fp8", params_atol=1e-6, sign=False,
                                                rms_cap=0.05)))
    checks.append(("FlexDeMo training (its defaults: preconditioned, the RMS-capped step)",
                   trains_on_the_gpu))
    failed = 0
    for name, check in checks:
        try:
            check()
            print("gpu ops: {}: passed".format(name), flush=True)
        except Exception as e:  # one line per failed check; the exit status says whether any
            failed += 1
            print("gpu ops: {}: FAILED: {}".format(name, e), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
