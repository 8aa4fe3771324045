"""Shared test setup: the ``gpu`` marker skips with a reason where no CUDA GPU is present, the ``slow`` tests run
last, and the Triton-interpreter children of the selected tests start right after collection (they run
alongside the suite)."""

import os

# One thread per test process: the Triton-interpreter children and the child runs of `jetrl` share the 2 cores
# with this process, and torch's OpenMP threads on oversubscribed cores spin instead of working, so a
# CPU-bound test runs longer with 2 threads than with 1 while another process holds a core. Children inherit
# the variable; set JETRL_TEST_THREADS to choose another count.
os.environ["OMP_NUM_THREADS"] = os.environ.get("JETRL_TEST_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    # the `slow` tests run last: by then the interpreter children are done and a slow test's child run of
    # `jetrl` has both cores to itself (see its thread count in tests/cli/test_commands.py)
    items.sort(key=lambda item: "slow" in item.keywords)  # stable: the order within each group is kept
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run scripts/gpu_check.sh on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    """Start the Triton-interpreter children of the selected CPU tests now, so they run alongside the suite
    (see ``tests/interpreted.py``). Under pytest-xdist each worker starts its own when it needs them."""
    if os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly:
        return
    import interpreted

    for item in session.items:
        module = getattr(item, "module", None)
        child = getattr(module, "_CHILD", None)
        if isinstance(child, str) and getattr(module, "run_interpreted", None) is interpreted.run_interpreted \
                and "gpu" not in item.keywords:
            interpreted.prestart(child)


def pytest_sessionfinish(session, exitstatus):
    import sys

    interpreted = sys.modules.get("interpreted")
    if interpreted is not None:
        interpreted.stop_all()


@pytest.fixture
def one_thread():
    """torch on one thread for the test (and back after): tiny matrices run fastest that way and do not fight the
    interpreter children for the cores, even where ``JETRL_TEST_THREADS`` gave this process more."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def gen():
    """A seeded CPU generator: fresh random inputs every test, reproducible runs."""
    return torch.Generator().manual_seed(1234)
