"""The runtime's memory tiers on CPU: offloaded saved activations and optimizer state give
bit-identical training, pools never hand out more than they hold, revocations move blocks to
host and are acknowledged to the agent."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid

import pytest
import torch
from torch import nn

from gpuherd import jobenv
from gpuherd.train.memory import ALIGN, MemoryTiers, MiB, Pool, peer_round_trips


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 16 * 16, 64),
        nn.GELU(),
        nn.Linear(64, 10),
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def grads(model: nn.Module, tiers: MemoryTiers | None) -> list[torch.Tensor]:
    x, y = batch()
    if tiers is None:
        loss = nn.functional.cross_entropy(model(x), y)
    else:
        with tiers.saved_tensors(model):
            loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_offloading_saved_activations_to_host_gives_bit_identical_gradients() -> None:
    reference = grads(cnn(), None)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
    pool = tiers.add_host(64)
    got = grads(cnn(), tiers)
    assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    assert tiers.stats.offloaded_bytes > MiB and tiers.stats.by_tier["host"] > 0
    assert tiers.stats.prefetched > 0  # backward brought layers back one ahead
    assert tiers.stats.kept_bytes > 0  # small tensors and parameters stay
    assert pool.live_front == 0 and pool.front == 0  # the step's blocks all came back when the graph died


def mlp_blocks(blocks: int = 12, width: int = 256) -> nn.Module:
    """Blocks of a Linear and two thin layers, each saving one tensor of the same size."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("prefetch_layers", [1.0, 4.0])
def test_backward_reloads_a_window_of_layers_ahead_and_stays_bit_identical(prefetch_layers: float) -> None:
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(2))

    def gradients(tiers: MemoryTiers | None) -> list[torch.Tensor]:
        model = mlp_blocks()
        with tiers.saved_tensors(model) if tiers is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = gradients(None)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024, prefetch_layers=prefetch_layers)
    tiers.add_host(64)
    assert all(torch.equal(a, b) for a, b in zip(reference, gradients(tiers), strict=True))
    tensor = 512 * 256 * 4  # each offloaded saved tensor: one per layer here
    assert tiers.stats.offloaded_bytes >= 30 * tensor
    # As many layers ahead as asked (the window is under an eighth of what went), never more than
    # one layer over it: a thin layer's reload no longer starts only when that layer does.
    assert tiers.stats.ahead_peak_bytes >= prefetch_layers * tensor
    assert tiers.stats.ahead_peak_bytes <= (prefetch_layers + 1) * tensor
    # Only the last layer's come back on demand (its LayerNorm's input and the loss's): backward begins there.
    assert tiers.stats.reloaded_on_demand == 2


def test_prefetch_layers_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="prefetch_layers"):
        MemoryTiers("cpu", prefetch_layers=0.5)


def test_a_full_pool_offloads_what_fits_and_keeps_the_rest_still_bit_identical() -> None:
    reference = grads(cnn(), None)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
    pool = tiers.add_host(0.6)
    got = grads(cnn(), tiers)
    assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    assert 0 < tiers.stats.offloaded_bytes <= pool.nbytes
    assert tiers.stats.kept_bytes > MiB


def test_keep_mb_leaves_the_step_s_newest_saved_tensors_on_the_device() -> None:
    reference = grads(cnn(), None)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024, keep_mb=1.0)
    tiers.add_host(64)
    first = grads(cnn(), tiers)  # no history yet: everything goes
    assert tiers.stats.kept_from_layer is None
    offloadable = tiers.stats.offloadable_bytes
    assert tiers.stats.offloaded_bytes == offloadable > 2 * MiB
    second = grads(cnn(), tiers)
    assert all(torch.equal(a, b) for a, b in zip(reference, first, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(reference, second, strict=True))
    assert tiers.stats.offloadable_bytes == offloadable  # the same step again
    # at least keep_mb stays (whole tensors, from the first that would cross the line)
    assert 0 < tiers.stats.offloaded_bytes <= offloadable - MiB
    assert tiers.stats.kept_from_layer is not None and tiers.stats.kept_from_layer > 1
    with tiers.saved_tensors(), torch.no_grad():  # a step that saves nothing: nothing to go by ...
        cnn()(batch()[0])
    grads(cnn(), tiers)  # ... so the next one offloads everything again, not nothing
    assert tiers.stats.offloaded_bytes == offloadable


def test_keep_mb_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="keep_mb"):
        MemoryTiers("cpu", keep_mb=-1)


def test_neighbor_pools_fill_before_host() -> None:
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
    host = tiers.add_host(64)
    peer = tiers.add_peer("cpu", 1, tier="nvlink")
    assert tiers.pools == [peer, host]
    grads(cnn(), tiers)
    assert tiers.stats.by_tier["nvlink"] > 0 and tiers.stats.by_tier["host"] > 0


def channels_last_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).to(
        memory_format=torch.channels_last
    )


def test_channels_last_activations_come_back_in_their_memory_format() -> None:
    x = torch.randn(4, 3, 32, 32).to(memory_format=torch.channels_last)
    ref_model, model = channels_last_model(), channels_last_model()
    ref_model(x).sum().backward()
    tiers = MemoryTiers("cpu", min_bytes=1024)
    tiers.add_host(16)
    with tiers.saved_tensors(model):
        out = model(x).sum()
    out.backward()
    assert tiers.stats.offloaded_bytes > 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref_model.parameters(), model.parameters(), strict=True))


def train(steps: int, tiers: MemoryTiers | None, *, revoke_after: int | None = None, lease_file=None) -> nn.Module:
    model = cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if tiers is not None:
        tiers.offload_optimizer(opt)
    for step in range(steps):
        if tiers is not None and revoke_after is not None and step == revoke_after:
            revoke(lease_file)
        if tiers is not None:
            tiers.poll()
        grads(model, tiers)
        opt.step()
        opt.zero_grad()
    return model


def test_optimizer_state_in_the_tiers_trains_bit_identically() -> None:
    reference = train(4, None)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
    pool = tiers.add_host(64)
    model = train(4, tiers)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))
    assert pool.persistent and pool.back < pool.nbytes  # Adam's moments live at the pool's back
    # they came back during backward, beside the reloads, every one of them
    assert tiers.stats.state_early_bytes == sum(block.nbytes for _, _, block in tiers._optimizer_state) > 0
    assert not tiers._state_back and not tiers._state_due, "step() took them all"


def test_optimizer_state_can_come_back_at_step_instead() -> None:
    reference = train(3, None)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024, state_in_backward=False)
    tiers.add_host(64)
    model = train(3, tiers)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))
    assert tiers.stats.state_early_bytes == 0 and tiers._optimizer_state


def test_gradients_accumulated_over_several_backwards_train_bit_identically() -> None:
    """Each backward brings the optimizer's state back; only the last one's reaches step()."""

    def accumulate(tiers: MemoryTiers | None) -> nn.Module:
        model = cnn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if tiers is not None:
            tiers.offload_optimizer(opt)
        for _ in range(3):
            for _ in range(2):
                grads(model, tiers)
            opt.step()
            opt.zero_grad()
        return model

    reference = accumulate(None)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
    tiers.add_host(64)
    model = accumulate(tiers)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))
    assert tiers.stats.state_early_bytes > 0


def test_dropped_tiers_free_their_pools_at_once() -> None:
    """No reference cycle holds a pool: a pinned buffer of tens of GiB must go when its tiers do,
    not when the cycle collector next runs (a second one would not fit in the meantime)."""
    import gc
    import weakref

    gc.disable()
    try:
        tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
        pool = weakref.ref(tiers.add_host(64))
        train(2, tiers)
        del tiers
        assert pool() is None
    finally:
        gc.enable()


# -- leases from the agent's file ---------------------------------------------------------------------------


def lease_file(tmp_path, *, revoke_by=None, ending_by=None) -> object:
    path = tmp_path / jobenv.MEMORY_LEASES_FILE
    shares = [
        {"tier": "nvlink", "gpu": 1, "device": None, "mb": 2, "revoke_by": revoke_by},
        {"tier": "host", "gpu": None, "device": None, "mb": 64, "revoke_by": None},
    ]
    path.write_text(json.dumps({"leases": {"L1": {"gpu": 0, "shares": shares, "ending_by": ending_by}}}))
    return path


def revoke(path) -> None:
    raw = json.loads(path.read_text())
    raw["leases"]["L1"]["shares"][0]["revoke_by"] = 123.0
    path.write_text(json.dumps(raw))


@pytest.fixture
def agent_socket(monkeypatch):
    """A datagram socket standing where the agent's control socket would."""
    name = f"gpuherd-test-{uuid.uuid4().hex[:8]}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    monkeypatch.setenv(jobenv.AGENT_ADDR, f"unix-abstract:{name}")
    yield sock
    sock.close()


def _messages(sock: socket.socket) -> list[dict]:
    """Every message the runtime sent to the agent so far, in order."""
    out = []
    sock.settimeout(0.2)
    with contextlib.suppress(TimeoutError):
        while True:
            out.append(json.loads(sock.recv(65536)))
    return out


def test_the_runtime_tells_its_agent_what_it_holds_on_each_lender_gpu_at_every_read(tmp_path, agent_socket):
    """On CPU every share is host memory: it holds nothing on a lender GPU. A share opened on a GPU
    counts (its device buffer, rounded to MiB) under its lender's index; a revoked one no more."""
    path = lease_file(tmp_path)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
    tiers.follow_leases(path, gpu=0)
    assert [(m["kind"], m["lease"], m["held_mb"]) for m in _messages(agent_socket)] == [("lease-held", "L1", {})]
    tiers.pools[0].device = torch.device("cuda", 0)  # as the nvlink share's pool would be on a GPU host
    assert tiers.held_on_lenders_mb() == {1: 2}
    tiers.pools[0].device = torch.device("cpu")
    revoke(path)
    os.utime(path, ns=(0, 10**18))  # a new mtime, whatever the file system's resolution
    tiers.poll()
    assert [m["kind"] for m in _messages(agent_socket)] == ["lease-released", "lease-held"]
    assert tiers.held_on_lenders_mb() == {}


def test_a_revoked_neighbor_share_moves_to_host_is_acknowledged_and_training_stays_exact(tmp_path, agent_socket):
    path = lease_file(tmp_path)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
    tiers.follow_leases(path, gpu=0)
    assert [p.name for p in tiers.pools] == ["lease:nvlink:1:0", "lease:host:None:0"]
    assert tiers.pools[0].nbytes == 2 * MiB - (2 * MiB) % ALIGN  # never more than the share
    reference = train(4, None)
    model = train(4, tiers, revoke_after=2, lease_file=path)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))
    assert [p.name for p in tiers.pools] == ["lease:host:None:0"]
    released = [m for m in _messages(agent_socket) if m["kind"] != "lease-held"]
    assert [(m["kind"], m["lease"], m["gpus"]) for m in released] == [("lease-released", "L1", [1])]
    tiers.poll()  # the same revocation is answered once
    assert _messages(agent_socket) == []


def test_a_whole_lease_revoked_spills_to_plain_ram_and_releases_it_all(tmp_path, agent_socket):
    path = lease_file(tmp_path)
    tiers = MemoryTiers("cpu", min_bytes=64 * 1024)
    tiers.follow_leases(path, gpu=0)
    model = train(2, tiers)
    lease_file(tmp_path, ending_by=500.0)
    os.utime(path, ns=(0, 10**18))  # a new mtime, whatever the file system's resolution
    tiers.poll()
    assert tiers.pools == []
    released = [m for m in _messages(agent_socket) if m["kind"] != "lease-held"]
    assert [(m["kind"], m["gpus"]) for m in released] == [("lease-released", [])]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_lease_for_another_gpu_is_not_this_process_s() -> None:
    tiers = MemoryTiers("cpu")
    assert tiers.poll() == []  # no lease file: no pools


def test_pool_blocks_never_overlap_and_persistent_gaps_are_reused() -> None:
    pool = Pool("p", "host", torch.device("cpu"), 10 * ALIGN)
    a = pool.take(ALIGN, persistent=True)
    b = pool.take(2 * ALIGN, persistent=True)
    f = pool.take(3 * ALIGN, persistent=False)
    assert (a, b, f) == (9 * ALIGN, 7 * ALIGN, 0)
    assert pool.take(5 * ALIGN, persistent=False) is None  # would run into the back
    pool.give_back(a, persistent=True)
    assert pool.take(ALIGN, persistent=True) == 9 * ALIGN  # the freed gap at the top
    pool.give_back(f, persistent=False)
    assert pool.front == 0 and pool.used == 3 * ALIGN


def test_a_peer_copy_on_the_same_device_round_trips() -> None:
    assert peer_round_trips(torch.device("cpu"), torch.device("cpu"))
