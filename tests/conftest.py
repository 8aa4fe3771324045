"""Shared test setup: the ``gpu`` marker skips with a reason where no CUDA GPU is present, the ``slow`` tests run
last, and the Triton-interpreter children of the selected tests are queued right after collection (they run
alongside the suite, at the lowest CPU priority)."""

import os

# One thread per test process: the Triton-interpreter children and the child runs of `jetrl` share the 2 cores
# with this process, and torch's OpenMP threads on oversubscribed cores spin instead of working, so a
# CPU-bound test runs longer with 2 threads than with 1 while another process holds a core. Children inherit
# the variable; set JETRL_TEST_THREADS to choose another count.
os.environ["OMP_NUM_THREADS"] = os.environ.get("JETRL_TEST_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _interpreted_children(item) -> tuple[str, ...]:
    """The Triton-interpreter children of ``item``'s module (its ``_CHILD``: one snippet or a tuple of them, run
    by ``tests/interpreted.py``); none for a module without."""
    import interpreted

    module = getattr(item, "module", None)
    if getattr(module, "run_interpreted", None) is not interpreted.run_interpreted:
        return ()
    child = getattr(module, "_CHILD", None)
    children = (child,) if isinstance(child, str) else child
    return children if isinstance(children, tuple) and all(isinstance(c, str) for c in children) else ()


def pytest_collection_modifyitems(config, items):
    # the modules that wait for an interpreter child run after the others, so this process has work of its own
    # while the children run; the `slow` tests run last: by then the interpreter children are done and a slow
    # test's child run of `jetrl` has both cores to itself (see its thread count in tests/cli/test_commands.py)
    items.sort(key=lambda item: ("slow" in item.keywords, bool(_interpreted_children(item))))  # stable
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run scripts/gpu_check.sh on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    """Queue the Triton-interpreter children of the selected CPU tests now, so they run alongside the suite
    (see ``tests/interpreted.py``). Under pytest-xdist each worker starts its own when it needs them."""
    if os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly:
        return
    import interpreted

    for item in session.items:
        if "gpu" not in item.keywords:
            for child in _interpreted_children(item):
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
