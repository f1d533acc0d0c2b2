"""Engines the tests drive, counting spies, and a dense reference momentum."""

import collections

import torch

from distzo import ZOConfig, ZOEngine
from distzo.engine import RESIDENT_BLOCK_ID
from tests.helpers.models import random_batch


def engine_for(model, weights=None, **overrides):
    options = dict(lr=1e-2, eps=1e-3, seed=3, device="cpu", noise_chunk=333, weight_decay=0.1)
    options.update(overrides)
    return ZOEngine(model, ZOConfig(**options), weights=weights)


def train(engine, vocab, steps=4, seed=0):
    return [engine.step(random_batch(vocab, pad="left", seed=seed + i)) for i in range(steps)]


def buckets_of(engine):
    return [(engine.resident_layout, RESIDENT_BLOCK_ID)] + [
        (layout, i + 1) for i, layout in enumerate(engine.block_layouts)
    ]


def frozen_values(engine):
    return dict(engine.stream_parameters(frozen=True))


FLOAT64 = dict(
    hidden_size=16,
    ffn_dim=32,
    num_attention_heads=2,
    word_embed_proj_dim=8,
    max_position_embeddings=16,
)


class Counting:
    def __init__(self, store):
        self.uploads, self.offloads = collections.Counter(), collections.Counter()
        upload = store.upload

        def counted_upload(i):
            self.uploads[i] += 1
            upload(i)

        def counted_offload(i):
            self.offloads[i] += 1

        store.upload, store.offload = counted_upload, counted_offload


BATCHINGS = {
    "dual": dict(dual_forward=True),
    "queries": dict(batch_queries=True),
    "both": dict(dual_forward=True, batch_queries=True),
}


def reference_momentum(engine, initial, results, beta1, window, wd):
    """Dense momentum over every trained tensor: m_t = sum_{k<W} beta1^k mean_j g_{t-k,j} z_{t-k,j},
    theta <- theta * (1 - lr wd on matrices) - lr m_t, z drawn by the engine's own noise."""
    layouts = [(0, engine.resident_layout)] + [
        (i + 1, layout) for i, layout in enumerate(engine.block_layouts)
    ]
    theta = {
        block: torch.cat([initial[e.names[0]].reshape(-1) for e in layout.entries]).double()
        for block, layout in layouts
    }
    for t, r in enumerate(results):
        for block, layout in layouts:
            m = torch.zeros_like(theta[block])
            for k in range(min(window, t + 1)):
                grads = results[t - k].projected_grads
                for j, g in enumerate(grads):
                    z = engine.noise.full(
                        layout.numel, step=t - k, block_id=block, query=j
                    ).double()
                    dense = torch.cat([z[e.offset : e.offset + e.numel] for e in layout.entries])
                    m += beta1**k * g / len(grads) * dense
            decay = torch.ones_like(theta[block])
            decay[: sum(e.numel for e in layout.entries if e.offset < layout.decay_end)] = (
                1 - r.lr * wd
            )
            theta[block] = theta[block] * decay - r.lr * m
    return {
        e.names[0]: theta[block][sum(x.numel for x in layout.entries[:n]) :][: e.numel].view(
            e.shape
        )
        for block, layout in layouts
        for n, e in enumerate(layout.entries)
    }


class LateOffloads:
    """A stand-in offload stream on CPU: a block's copy back to its host memory lands only
    when the host waits for the streams (``Streams.synchronize``, the collectives' host
    sync) or when an upload waits for it (the scheduler's event; FIFO, so all earlier
    ones too), as a CUDA offload stream's non-blocking copies do. Until then the host
    memory still holds the block's previous values."""

    def __init__(self, engine, monkeypatch):
        store, self.pending = engine.store, []
        offload, upload = store.offload, store.upload
        synchronize, host_sync = engine.streams.synchronize, engine.parallel.comm.host_sync

        def late_offload(i):
            host = store.master(i)
            before = host.clone()
            offload(i)
            self.pending.append((host, host.clone()))
            host.copy_(before)  # queued, not landed

        def waiting_upload(i):
            self.land()
            upload(i)

        def landing(wait):
            def waited():
                self.land()
                wait()

            return waited

        monkeypatch.setattr(store, "offload", late_offload)
        monkeypatch.setattr(store, "upload", waiting_upload)
        monkeypatch.setattr(engine.streams, "synchronize", landing(synchronize))
        monkeypatch.setattr(engine.parallel.comm, "host_sync", landing(host_sync))

    def land(self):
        for host, value in self.pending:
            host.copy_(value)
        self.pending.clear()


def replayed_config(config: ZOConfig, **header) -> ZOConfig:
    """The engine ``distzo.replay`` rebuilds from a seed log header of a run of ``config``
    (the fields it reads, as ``run_header`` writes them; ``header`` overrides them)."""
    from distzo.config.engine_options import lowrank_record, optimizer_record
    from distzo.replay import replay_config
    from distzo.zo.noise import noise_identity

    logged = {
        "run_seed": config.seed,
        "noise_chunk": config.noise_chunk,
        "noise": noise_identity(config.noise),
        "lowrank": lowrank_record(config),
        "weight_decay": config.weight_decay,
        "device_type": "cpu",
        "transfer_dtype": config.transfer_dtype,
        "optimizer": optimizer_record(config),
    }
    return replay_config({**logged, **header}, None)


def export_shard_bytes(monkeypatch, engine, directory, max_shard_size) -> list[int]:
    """The bytes of each safetensors file the export of ``engine`` held before writing it
    (rank 0 collects a file's tensors first): what the memory plan sizes."""
    from distzo.export import hf_model

    held: list[int] = []
    save_file = hf_model.save_file

    def spied(tensors, path, metadata=None):
        held.append(sum(t.nbytes for t in tensors.values()))
        return save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(hf_model, "save_file", spied)
    hf_model.export_model(engine, directory, max_shard_size=max_shard_size)
    return held
