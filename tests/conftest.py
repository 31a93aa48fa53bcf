"""Test-wide settings. On CUDA the engine is compared with references run on the same GPU, so
TF32 is off and cuDNN is deterministic: the tolerances then hold on CPU and CUDA alike.

cpu_kernel.py's C++ loop is built once per machine (torch's extension cache, shared by every process of the
session, ~/.cache/torch_extensions or TORCH_EXTENSIONS_DIR): on a fresh clone the build (about 35 s of one core)
stood inside whichever test first loaded the kernel, test_bench's benchmark processes or test_optim_lowp. When
tests that load it are collected, one background process builds it at the session's start (in the first
pytest-xdist worker where the suite runs in several), beside the tests; a process that needs the kernel meanwhile
waits for that build on torch's file lock, so none builds twice. RPTRAIN_TEST_PREBUILD=0 switches this off."""
import os
import signal
import subprocess
import sys

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False

# Test modules whose tests load the C++ loop, in this process or in the benchmark processes they start.
KERNEL_MODULES = {"test_bench.py", "test_optim_lowp.py"}
_prebuild: "subprocess.Popen | None" = None


def pytest_collection_finish(session):
    global _prebuild
    if session.config.option.collectonly or os.environ.get("RPTRAIN_TEST_PREBUILD", "1") == "0":
        return
    if not any(item.path.name in KERNEL_MODULES for item in session.items):
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # under pytest-xdist every worker collects everything: the first one builds for all
    # The build as the tests would do it (same call, same cache; where the cache is warm, a check of a few seconds).
    # A failed build is the tests' business: they fall back or skip as they would have.
    _prebuild = subprocess.Popen([sys.executable, "-c", "from rptrain.optim import cpu_kernel; cpu_kernel.kernel()"],
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session):
    """A build no test waited for (a run of a few tests) is stopped with its compiler: the session does not wait on
    it, and gcc and ninja remove what they had half written, so a later process builds again from the start."""
    if _prebuild is None or _prebuild.poll() is not None:
        return
    _signal_prebuild(signal.SIGTERM)
    try:
        _prebuild.wait(timeout=30)
    except subprocess.TimeoutExpired:
        _signal_prebuild(signal.SIGKILL)
        _prebuild.wait()


def _signal_prebuild(signum: int) -> None:
    try:
        os.killpg(_prebuild.pid, signum)  # its own session: the build's ninja and gcc too, nothing else
    except ProcessLookupError:
        pass
