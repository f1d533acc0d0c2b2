"""A low-bit block's master rebuilt a chunk at a time (``low_bit_master="recompute"``):
the buffered trajectory bit for bit, without the float32 block on the device; and in two
buffers, upcast and rounded beside the compute (``"double"``): the same trajectory again."""

import pytest
import torch

from distzo import ZOConfig, ZOEngine
from distzo.data import CountingTask
from distzo.engine.parts import describe
from distzo.offload import BucketLayout, Shard, StreamedBlocks
from distzo.offload.low_bit import TRANSFER_DTYPES
from distzo.zo import NoiseSource
from tests.helpers.launch import train_in_process
from tests.helpers.models import tiny_opt


@pytest.mark.parametrize("kind", ["gaussian", "rademacher", "legacy"])
def test_a_piece_of_a_bucket_takes_the_update_of_its_places(kind):
    """apply_terms on elements [start, stop) of a bucket: the bits of those elements of the
    whole bucket's update, the decay ending inside a piece, pieces not aligned to the
    noise's own."""
    noise = NoiseSource(5, 64, torch.device("cpu"), torch.float32, kind=kind)
    total, decay_end = 1000, 410
    terms = [(3, 0, -0.3), (3, 1, 0.2), (2, 0, 0.05)]
    whole = torch.randn(total, generator=torch.Generator().manual_seed(0))
    expected = whole.clone()
    noise.apply_terms(expected, decay_end, 0.99, terms, 7)
    for size in (100, 37, 1000):
        rebuilt = whole.clone()
        for start in range(0, total, size):
            piece = rebuilt[start : start + size]
            noise.apply_terms(piece, decay_end, 0.99, terms, 7, start, total)
        assert torch.equal(rebuilt.view(torch.int32), expected.view(torch.int32)), size


def trajectory(master, steps=4, **options):
    """Each step's loss, an evaluation with the update pending (applied on the way, not
    written back), one more step; then the blocks at rest and the resident master."""
    model = tiny_opt(seed=0)
    task = CountingTask(model.config.vocab_size, seed=0)
    config = ZOConfig(lr=1e-2, eps=1e-2, seed=0, device="cpu", low_bit_master=master, **options)
    engine = ZOEngine(model, config)
    losses = [engine.step(task.batch(8)).loss for _ in range(steps)]
    evaluation = task.batch(8)
    evaluation["labels"] = evaluation["input_ids"]
    losses.append(engine.forward(evaluation)[1].item())
    losses.append(engine.step(task.batch(8)).loss)
    engine.flush()
    return engine, losses


@pytest.mark.parametrize(
    "options",
    [
        {"transfer_dtype": "bf16"},
        {"transfer_dtype": "fp8", "weight_decay": 0.1, "noise_chunk": 1000},
        {
            "transfer_dtype": "fp16",
            "compute_dtype": "fp16",
            "optimizer": "momentum",
            "num_queries": 2,
            "noise_chunk": 777,
        },
        {"transfer_dtype": "bf16", "estimator": "fzoo", "num_queries": 3, "noise_chunk": 999},
        {"transfer_dtype": "bf16", "noise": "lowrank", "weight_decay": 0.5, "noise_chunk": 1001},
        {"transfer_dtype": "bf16", "noise": "legacy", "noise_chunk": 1001},
    ],
    ids=["bf16", "fp8-decay", "fp16-momentum-q2", "fzoo", "lozo-decay", "legacy"],
)
def test_recomputed_masters_follow_the_buffered_trajectory_bit_for_bit(options):
    buffered, losses = trajectory("buffer", **options)
    rebuilt, rebuilt_losses = trajectory("recompute", **options)
    assert rebuilt_losses == losses
    assert len(set(losses)) == len(losses)  # the steps moved the weights
    at_rest = buffered.store.host_storage.view(torch.uint8)
    assert torch.equal(rebuilt.store.host_storage.view(torch.uint8), at_rest)
    assert torch.equal(rebuilt.resident_master, buffered.resident_master)
    # K slots of the wire format and a noise chunk of float32, where the buffer held a block
    store, wire = rebuilt.store, TRANSFER_DTYPES[options["transfer_dtype"]].itemsize
    biggest = max(store.padded)
    assert buffered.store.device_bytes == biggest * (3 * wire + 4)
    assert store.device_bytes == biggest * 3 * wire
    assert rebuilt.rebuilt.device_bytes == min(rebuilt.config.noise_chunk, biggest) * 4
    assert buffered.rebuilt is None
    # the engine's log line says which
    assert "masters rebuilt per pass" in describe(rebuilt, torch.float32)
    assert "masters rebuilt" not in describe(buffered, torch.float32)


@pytest.mark.parametrize(
    "options",
    [
        {"transfer_dtype": "fp16", "weight_decay": 0.1, "noise_chunk": 1000},
        {"transfer_dtype": "bf16", "optimizer": "adam", "state_dtype": "bf16", "num_slots": 2},
    ],
    ids=["fp16-decay", "adam-bf16-moments-2-slots"],
)
def test_double_buffered_masters_follow_the_buffered_trajectory_bit_for_bit(options):
    """The upcast moved to the upload stream and the rounding to the offload stream
    change where they run, not what they compute: the same losses and the same bits at
    rest, bf16 moments included (they travel with their blocks, in two buffers of their
    own), for one float32 block more."""
    buffered, losses = trajectory("buffer", **options)
    double, double_losses = trajectory("double", **options)
    assert double_losses == losses
    assert len(set(losses)) == len(losses)
    at_rest = buffered.store.host_storage.view(torch.uint8)
    assert torch.equal(double.store.host_storage.view(torch.uint8), at_rest)
    assert torch.equal(double.resident_master, buffered.resident_master)
    store = double.store
    assert store.double_buffered and not buffered.store.double_buffered
    assert double.scheduler.store.double_buffered
    biggest = max(store.padded)
    assert store.device_bytes - buffered.store.device_bytes == biggest * 4
    for moment, reference in zip(double.moments.blocks, buffered.moments.blocks):
        assert moment.double_buffered and len(moment.unpacked) == 2
        bits = reference.host_storage.view(torch.uint8)
        assert torch.equal(moment.host_storage.view(torch.uint8), bits)
    assert "upcast and rounded beside the compute" in describe(double, torch.float32)
    # the memory plan counts the second buffer of the weights and of each bf16 moment
    from distzo.job.memory_plan import plan_memory

    plans = [
        plan_memory(tiny_opt(seed=0), engine.config, 1, False, batch=8, seq=8)
        for engine in (buffered, double)
    ]
    moments = len(double.moments.blocks)
    assert plans[1].device_bytes - plans[0].device_bytes == (1 + moments) * biggest * 4


def test_round_piece_rounds_the_pieces_a_rank_owns_as_pack_does():
    """A sliced rank's write-back from rebuilt pieces: its own pieces of the slot rounded
    bit for bit as from the buffer, the other rank's pieces left as they arrived."""
    layouts = [BucketLayout((), 5000, 0, torch.float32)]  # one block of 5,000 elements
    rounding = NoiseSource(9, 1 << 12, torch.device("cpu"), torch.float32, "uniform")
    made = {}
    for buffer in (True, False):
        store = StreamedBlocks(
            layouts,
            torch.device("cpu"),
            2,
            torch.bfloat16,
            Shard(None, 1, 2),
            rounding,
            chunks=2,
            master_buffers=1 if buffer else 0,
        )
        store.step = 4
        wire = store.wire(0)
        wire.copy_(torch.randn(wire.numel(), generator=torch.Generator().manual_seed(1)))
        made[buffer] = (store, wire.clone())
    (buffered, arrived), (rebuilding, _) = made[True], made[False]
    assert rebuilding.rebuilds and rebuilding.unpacked is None and not buffered.rebuilds

    def moved(values):
        return values.float() * 1.001 + 1e-3

    buffered.unpack(0)
    master = buffered.device_bucket(0)
    master.copy_(moved(master))
    buffered.pack(0)

    rebuilding.pack(0)  # without the buffer, pack leaves the slot to round_piece
    assert torch.equal(rebuilding.wire(0).view(torch.int16), arrived.view(torch.int16))
    for lo, hi in rebuilding.share_ranges(0):  # this rank's pieces, 300 elements at a time
        for a in range(lo, hi, 300):
            rebuilding.round_piece(0, a, moved(rebuilding.wire(0)[a : min(a + 300, hi)]))
    after = rebuilding.wire(0).view(torch.int16)
    assert torch.equal(after, buffered.wire(0).view(torch.int16))
    owned = torch.zeros(after.numel(), dtype=torch.bool)
    for lo, hi in rebuilding.share_ranges(0):
        owned[lo:hi] = True
    assert 0 < owned.sum() < 5000
    assert torch.equal(after[~owned], arrived.view(torch.int16)[~owned])
    assert not torch.equal(after[owned], arrived.view(torch.int16)[owned])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"low_bit_master": "none"}, "must be one of buffer, double, recompute"),
        ({"low_bit_master": "recompute"}, "use mode offload with transfer_dtype bf16"),
        (
            {"low_bit_master": "recompute", "mode": "resident", "transfer_dtype": "fp32"},
            "use mode offload with transfer_dtype bf16",
        ),
        (
            {"low_bit_master": "recompute", "transfer_dtype": "bf16", "optimizer": "adam"},
            "stored moments",
        ),
        ({"low_bit_master": "double"}, "low_bit_master double places the float32 master"),
    ],
)
def test_a_recomputed_master_needs_a_low_bit_transfer_and_a_stateless_update(options, message):
    with pytest.raises(ValueError, match=message) as info:
        ZOConfig(**options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("master", ["recompute", "double"])
def test_an_adapter_run_refuses_a_master_placed_otherwise(master):
    proc = train_in_process(
        ["--peft", "lora", "--transfer-dtype", "bf16", "--low-bit-master", master]
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--low-bit-master {master} places" in lines[0], proc.stderr


def fallbacks_of(*flags):
    from distzo.config.job import resolve
    from distzo.job.build import device_fallbacks

    job = resolve(list(flags))
    return [
        (c.num_slots, c.low_bit_master, c.perturb_scope, why)
        for c, why in device_fallbacks(job, job.engine_config("cpu"))
    ]


def test_the_job_perturbs_by_module_then_drops_the_master_buffer_before_a_slot():
    from distzo.job.build import MODULE_FALLBACK, RECOMPUTE_FALLBACK, SLOTS_FALLBACK

    m, r, s = MODULE_FALLBACK, RECOMPUTE_FALLBACK, SLOTS_FALLBACK
    assert fallbacks_of("--transfer-dtype", "bf16") == [
        (3, "buffer", "block", []),
        (3, "buffer", "module", [m]),
        (3, "recompute", "block", [r]),
        (3, "recompute", "module", [m, r]),
        (2, "buffer", "block", [s]),
        (2, "buffer", "module", [m, s]),
        (2, "recompute", "block", [r, s]),
        (2, "recompute", "module", [m, r, s]),
    ]
    # what an option settles, or what cannot rebuild, is never tried
    assert fallbacks_of(
        "--transfer-dtype", "bf16", "--low-bit-master", "buffer", "--perturb-scope", "block"
    ) == [(3, "buffer", "block", []), (2, "buffer", "block", [s])]
    assert fallbacks_of(
        "--transfer-dtype", "bf16", "--num-slots", "3", "--perturb-scope", "module"
    ) == [
        (3, "buffer", "module", []),
        (3, "recompute", "module", [r]),
    ]
    assert [(b, p) for _, b, p, _ in fallbacks_of()] == [  # an fp32 link
        ("buffer", "block"),
        ("buffer", "module"),
        ("buffer", "block"),
        ("buffer", "module"),
    ]
    adam = fallbacks_of("--transfer-dtype", "bf16", "--optimizer", "adam")
    assert [b for _, b, _, _ in adam] == ["buffer"] * 4
    lora = fallbacks_of("--transfer-dtype", "bf16", "--peft", "lora")
    assert [(b, p) for _, b, p, _ in lora] == [("buffer", "block")] * 2
    assert fallbacks_of("--mode", "resident") == [
        (3, "buffer", "block", []),
        (3, "buffer", "module", [m]),
    ]


def test_the_first_layout_that_fits_is_the_runs(monkeypatch, caplog):
    """choose_slots takes the first fallback whose plan fits, records it in the job (its
    config.toml) and says in the log what it gave up; where none fits, the first plan."""
    from types import SimpleNamespace

    from distzo.config.job import resolve
    from distzo.job import build

    def plan_of(job, model, data, config, parallel, device):
        need = config.num_slots * 2 + (4 if config.low_bit_master == "buffer" else 0)
        need -= config.perturb_scope == "module"
        return SimpleNamespace(need=need, config=config)

    def fits_under(budget):
        def check(plan, device, local_ranks, force):
            if plan.need > budget:
                raise ValueError("the run does not fit")

        return check

    parallel = SimpleNamespace(
        env=SimpleNamespace(local_world_size=1), comm=SimpleNamespace(distributed=False)
    )
    monkeypatch.setattr(build, "memory_plan", plan_of)
    for budget, chosen in [
        (10, (3, "buffer", "block")),
        (9, (3, "buffer", "module")),
        (6, (3, "recompute", "block")),
        (5, (3, "recompute", "module")),
        (4, (2, "recompute", "block")),
    ]:
        monkeypatch.setattr(build, "check_fits", fits_under(budget))
        job = resolve(["--transfer-dtype", "bf16"])
        config = job.engine_config("cpu")
        with caplog.at_level("INFO", logger="distzo.train"):
            caplog.clear()
            plan = build.choose_slots(job, None, None, config, parallel, None)
        assert (config.num_slots, config.low_bit_master, config.perturb_scope) == chosen
        offload = job.offload
        assert (offload.num_slots, offload.low_bit_master, offload.perturb_scope) == chosen
        assert plan.config.num_slots == chosen[0] and plan.need <= budget
        assert (build.MODULE_FALLBACK in caplog.text) == (chosen[2] == "module")
        assert (build.RECOMPUTE_FALLBACK in caplog.text) == (chosen[1] == "recompute")
        assert (build.SLOTS_FALLBACK in caplog.text) == (chosen[0] == 2)
    monkeypatch.setattr(build, "check_fits", fits_under(1))
    job = resolve(["--transfer-dtype", "bf16"])
    config = job.engine_config("cpu")
    plan = build.choose_slots(job, None, None, config, parallel, None)
    assert plan.need == 10
    assert (config.num_slots, config.low_bit_master, config.perturb_scope) == (3, "buffer", "block")


def test_every_rank_takes_the_first_layout_that_fits_on_all_of_them(monkeypatch):
    """Once each rank took the first layout fitting its own GPU: a GPU with less free
    memory ran 2 slots where its peers ran 3, and rank 0 recorded its own choice."""
    from types import SimpleNamespace

    from distzo.config.job import resolve
    from distzo.job import build

    def plan_of(job, model, data, config, parallel, device):
        return SimpleNamespace(
            need=config.num_slots * 2 + (4 if config.low_bit_master == "buffer" else 0)
        )

    def fits_under(plan, device, local_ranks, force):
        if plan.need > 10:  # this rank: everything fits
            raise ValueError("the run does not fit")

    class PeerLowOnMemory:
        distributed = True

        def all_gather_object(self, fits):
            # the peer's GPU fits only the plans of 4 or less: masters rebuilt, 2 slots
            peer = [plan_need <= 4 for plan_need in needs]
            return [fits, peer]

    job = resolve(["--transfer-dtype", "bf16"])
    config = job.engine_config("cpu")
    needs = [
        plan_of(None, None, None, c, None, None).need
        for c, _ in build.device_fallbacks(job, config)
    ]
    monkeypatch.setattr(build, "memory_plan", plan_of)
    monkeypatch.setattr(build, "check_fits", fits_under)
    parallel = SimpleNamespace(env=SimpleNamespace(local_world_size=1), comm=PeerLowOnMemory())
    plan = build.choose_slots(job, None, None, config, parallel, None)
    assert (config.num_slots, config.low_bit_master, config.perturb_scope) == (
        2,
        "recompute",
        "block",
    )
    assert job.offload.num_slots == 2 and plan.need == 4


def test_a_pass_takes_the_fused_kernel_only_where_it_gives_the_same_bits():
    """RebuiltMaster.perturb_into asks the noise for its fused kernel (CUDA's
    rebuild_perturb, here a spy that declines after noting the call) for a perturbed pass
    with at most one update; an unperturbed pass (a copy, -0.0 kept) and a catch-up's
    several updates go piece by piece."""
    from distzo.engine.rebuilt_master import BlockVisit, RebuiltMaster
    from distzo.engine.updates import PendingUpdate, UpdateRule

    class Spy(NoiseSource):
        asked: list[float] = []

        def rebuild_perturb_into(self, out, at_rest, *args, **kwargs):
            decay_end, shrink, terms, block_id, scale, step, query, start = args
            self.asked.append(scale)
            self.parts.append((start, at_rest.numel()))
            return False

        parts: list[tuple[int, int]] = []

    layout = BucketLayout((), 3000, 1000, torch.float32)
    noise = Spy(1, 1000, torch.device("cpu"), torch.float32)
    store = StreamedBlocks([layout], torch.device("cpu"), 1, torch.bfloat16, rounding_noise=noise)
    rebuilt = RebuiltMaster(store, 700, torch.device("cpu"), torch.float32)
    rule = UpdateRule(ZOConfig(device="cpu", weight_decay=0.1), noise)
    at_rest = torch.randn(3000).bfloat16()
    one, two = [PendingUpdate(4, (0.3,), 1e-2)], [PendingUpdate(3, (0.2,), 1e-2)] * 2
    out = torch.empty(3000)
    for updates, scale in [(one, 1e-3), ([], -1e-3), (one, 0.0), (two, 1e-3)]:
        visit = BlockVisit(at_rest, updates, rule, noise, layout, 1)
        rebuilt.perturb_into(out, visit, scale, 5, 0)
    assert Spy.asked == [1e-3, -1e-3]
    # declined, the pieces gave the master's perturbation: the composed ops on the whole
    master = at_rest.float()
    for update in two:
        rule.apply(noise, update, master, layout, 1, [])
    expected = torch.empty(3000)
    noise.perturb_into(expected, master, 1e-3, 5, 1, 0)
    assert torch.equal(out, expected)
    # one module's part (perturb_scope="module"): asked at its offset, and declined, the
    # pieces of that part give the whole block's values there
    Spy.asked.clear()
    Spy.parts.clear()
    visit = BlockVisit(at_rest, one, rule, noise, layout, 1)
    part = torch.empty(1234)
    rebuilt.perturb_range(part, visit, 1e-3, 5, 0, 1500, 2734)
    assert (Spy.asked, Spy.parts) == ([1e-3], [(1500, 1234)])
    whole = torch.empty(3000)
    rebuilt.perturb_into(whole, visit, 1e-3, 5, 0)
    assert torch.equal(part, whole[1500:2734])
