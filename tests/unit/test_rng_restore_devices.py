"""The RNG a rescale carries moves between nodes that see different numbers of GPUs: the CUDA
generator taken is the source's training device's, and it goes to the receiver's training device.
On CPU, CUDA is pretended: generators exist for the pretended devices only, as in torch, where a
device a process does not see has none (``default_generators[i]`` raises IndexError)."""

from __future__ import annotations

import pytest
import torch

from gpuherd.train.elastic.state import rng_state, set_rng_state


class PretendCuda:
    """``devices`` CUDA generators, training on ``current``; what torch.cuda's RNG calls see."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, devices: int, current: int) -> None:
        self.devices, self.current = devices, current
        self.states = {index: torch.full((8,), index, dtype=torch.uint8) for index in range(devices)}
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
            monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
            monkeypatch.setattr(module, "get_rng_state_all", lambda: [self.get_rng_state(i) for i in range(devices)])
            monkeypatch.setattr(module, "set_rng_state_all", self.set_rng_state_all)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)

    def _index(self, device: int | str | torch.device) -> int:
        index = torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index
        index = self.current if index is None else index
        if index >= self.devices:
            raise IndexError(f"no generator for device {index}: this process sees {self.devices}")
        return index

    def get_rng_state(self, device: int | str | torch.device = "cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set_rng_state(self, new_state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
        self.states[self._index(device)] = new_state.clone()

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        for index, state in enumerate(new_states):
            self.set_rng_state(state, index)


def test_a_state_taken_on_a_node_with_more_gpus_restores_on_one_with_fewer(monkeypatch: pytest.MonkeyPatch) -> None:
    source = PretendCuda(monkeypatch, devices=4, current=2)
    taken = rng_state()
    trained_on = source.states[2].clone()

    with monkeypatch.context() as receiving:
        receiver = PretendCuda(receiving, devices=1, current=0)
        set_rng_state(taken)  # before: IndexError for device 1, and every switch rolled back
        assert torch.equal(receiver.states[0], trained_on)  # the source's training device's stream


def test_a_state_with_one_generator_per_device_restores_those_the_receiver_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = {**rng_state(), "cuda": [torch.full((8,), 10 + index, dtype=torch.uint8) for index in range(3)]}
    receiver = PretendCuda(monkeypatch, devices=1, current=0)
    set_rng_state(taken)  # a checkpoint of an older gpuherd, from a node with 3 GPUs
    assert torch.equal(receiver.states[0], torch.full((8,), 10, dtype=torch.uint8))
