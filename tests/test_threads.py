"""torch's CPU threads: the default for given cores and reward workers, and the user's choice winning over it."""

import pytest
import torch

from jetrl.config import ConfigError, load_config
from jetrl.asset_files import DEFAULT_CONFIG, resolve_asset
from jetrl.rl.loop import configure_run_threads, reward_pool_config
from jetrl.threads import THREADS_ENV, available_cores, configure_threads, default_num_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores, workers, expected", [
    (1, 0, 1), (1, 2, 1),
    (2, 0, 1), (2, 2, 1),  # a 2-core laptop: one thread, so a second run beside it does not oversubscribe
    (4, 2, 2), (4, 3, 1),  # the reward workers take what they need of the cores
    (8, 2, 4), (16, 2, 8), (64, 2, 32),  # half the cores: two runs side by side fill the machine
])
def test_default_thread_count(cores, workers, expected):
    assert default_num_threads(cores, workers) == expected


def test_default_thread_count_rejects_nonsense():
    with pytest.raises(ValueError, match="num_cores"):
        default_num_threads(0)
    with pytest.raises(ValueError, match="num_reward_workers"):
        default_num_threads(4, -1)


def test_explicit_count_wins(monkeypatch, restore_threads):
    monkeypatch.setenv(THREADS_ENV, "1")
    assert configure_threads(3, num_reward_workers=2) == 3 and torch.get_num_threads() == 3
    with pytest.raises(ValueError, match=">= 1"):
        configure_threads(0)


def test_omp_num_threads_is_respected(monkeypatch, restore_threads):
    """With OMP_NUM_THREADS set, jetrl leaves torch's count as it stands (the user's, e.g. set by
    torch.set_num_threads after start-up)."""
    monkeypatch.setenv(THREADS_ENV, "5")
    torch.set_num_threads(3)
    assert configure_threads(None, num_reward_workers=2) == 3 and torch.get_num_threads() == 3


def test_default_applies_without_a_choice(monkeypatch, restore_threads):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    torch.set_num_threads(7)
    expected = default_num_threads(available_cores(), 2)
    assert configure_threads(None, num_reward_workers=2) == expected and torch.get_num_threads() == expected


def test_a_run_uses_its_config_and_its_reward_workers(monkeypatch, restore_threads):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    config = load_config(resolve_asset(DEFAULT_CONFIG))
    workers = reward_pool_config(config).num_workers
    assert workers >= 1
    assert configure_run_threads(config) == default_num_threads(available_cores(), workers)
    config = load_config(resolve_asset(DEFAULT_CONFIG), ["--trainer.num_threads=3"])
    assert configure_run_threads(config) == 3 and torch.get_num_threads() == 3
    with pytest.raises(ConfigError, match="trainer.num_threads"):
        load_config(resolve_asset(DEFAULT_CONFIG), ["--trainer.num_threads=0"])
