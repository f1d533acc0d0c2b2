"""The ZO2 peer's parts that need no ZO2: its shapes are distzo's, and bad input is one
protocol line (the harness prints it) before anything is built."""

import json
import subprocess
import sys

import pytest
import torch

from distzo.bench.peer_models import PEER_SHAPES, QWEN3, peer_config
from distzo.models.shapes import OPT_SHAPES, OTHER_SHAPES
from tests.helpers.launch import child_env, run_python
from tests.helpers.scripts import BENCHMARKS, benchmark_script

PEER = BENCHMARKS / "peer_zo2.py"


@pytest.fixture(scope="module")
def peer():
    with benchmark_script("peer_zo2") as module:
        yield module


def test_zo2_peer_builds_the_shapes_distzo_builds(peer):
    assert peer.OPT_SHAPES == OPT_SHAPES
    qwen3 = {n: s for n, s in OTHER_SHAPES.items() if n in QWEN3}  # the dense ones
    assert peer.QWEN3_SHAPES == {
        n: (s.hidden, s.layers, s.heads, s.kv_heads, s.ffn) for n, s in qwen3.items()
    }
    assert {s.head_dim for s in qwen3.values()} == {peer.QWEN3_HEAD_DIM}
    assert peer.SHAPES == list(PEER_SHAPES)


def peer_args(peer, shape: str, *overrides: str):
    return peer.parse_args(
        ["--zo2", "x", "--system", "zo2-mezo", "--shape", shape, "--seq", "64", *overrides]
    )


@pytest.mark.parametrize("overrides", [(), ("--layers", "4", "--hidden", "256")])
@pytest.mark.parametrize("shape", PEER_SHAPES)
def test_both_peers_build_the_same_config(peer, shape, overrides):
    """Field by field (under this interpreter's transformers): ZO2's peer and distzo's."""
    ours = peer_config(shape, 4 if overrides else None, 256 if overrides else None, 64)
    assert peer.model_config(peer_args(peer, shape, *overrides)).to_dict() == ours.to_dict()


def test_hidden_override_sets_ffn_and_heads_as_the_harness_does(peer):
    c = peer.model_config(peer_args(peer, "opt-125m"))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.ffn_dim) == (
        768, 12, 12, 3072,
    )  # fmt: skip
    c = peer.model_config(peer_args(peer, "opt-125m", "--layers", "4", "--hidden", "256"))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.ffn_dim) == (
        256, 4, 4, 1024,
    )  # fmt: skip
    # Qwen3: 128-wide heads, ffn 3 H, kv heads gcd(H / 128, 8), untied, positions = seq
    c = peer.model_config(peer_args(peer, "qwen3-8b", "--layers", "2", "--hidden", "768"))
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (768, 2, 2304)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (6, 2, 128)
    assert not c.tie_word_embeddings and c.max_position_embeddings == 64
    assert c.vocab_size == 151936 and c.max_window_layers == 2 and not c.use_sliding_window


def test_a_qwen3_width_off_the_head_width_is_one_error_line(tmp_path):
    out = run_peer(
        "--zo2", str(tmp_path), "--system", "zo2-mezo", "--shape", "qwen3-0.6b",
        "--hidden", "192", "--device", "cpu", "--dtype", "fp32",
    )  # fmt: skip
    assert out.returncode == 1
    (line,) = out.stdout.splitlines()
    assert json.loads(line)["error"] == "--hidden 192 must be a multiple of 128 for Qwen3"


def run_peer(*argv: str) -> subprocess.CompletedProcess:
    """``python benchmarks/peer_zo2.py ARGV`` (a fork server's child where it can be)."""
    return run_python([sys.executable, str(PEER), *argv], child_env(), 120)


def test_a_missing_checkout_is_one_error_line(tmp_path):
    out = run_peer(
        "--zo2", str(tmp_path / "nope"), "--system", "zo2-mezo", "--shape", "opt-125m",
        "--device", "cpu", "--dtype", "fp32",
    )  # fmt: skip
    assert out.returncode == 1
    (line,) = out.stdout.splitlines()
    assert "not a ZO2 checkout" in json.loads(line)["error"]


def test_offload_on_cpu_is_refused_in_one_line(tmp_path):
    out = run_peer(
        "--zo2", str(tmp_path), "--system", "zo2-offload", "--shape", "opt-125m",
        "--device", "cpu",
    )  # fmt: skip
    assert out.returncode == 1
    assert "needs CUDA" in json.loads(out.stdout)["error"]


def test_a_print_of_zo2s_goes_to_stderr_not_into_the_protocol(tmp_path):
    # a stand-in checkout whose import prints, as ZO2's offload set-up does
    package = tmp_path / "zo2"
    (package / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config" / "__init__.py").write_text("")
    (package / "config" / "mezo_sgd.py").write_text(
        "print('Upload head and tail to cuda.')\nraise RuntimeError('stand-in stops here')\n"
    )
    out = run_peer(
        "--zo2", str(tmp_path), "--system", "zo2-mezo", "--shape", "opt-125m",
        "--device", "cpu", "--dtype", "fp32",
    )  # fmt: skip
    assert out.returncode == 1
    (line,) = out.stdout.splitlines()  # the error line only
    assert "stand-in stops here" in json.loads(line)["error"]
    assert "Upload head and tail to cuda." in out.stderr


def test_the_random_fill_is_opts_init_drawn_in_float32_chunk_by_chunk(peer, monkeypatch):
    """Matrices ~ N(0, 0.02) drawn in float32 then rounded (one generator, the parameters
    in order, a chunk at a time), biases 0, norm scales 1: the init ZO2's speed test gets,
    without drawing fp16 Gaussians on the host."""
    from transformers import OPTConfig, OPTForCausalLM

    monkeypatch.setattr(peer, "FILL_CHUNK", 1000)  # several chunks per matrix
    config = OPTConfig(
        num_hidden_layers=1, hidden_size=32, ffn_dim=64, num_attention_heads=2,
        vocab_size=96, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    model = OPTForCausalLM(config).to(torch.float16)
    for p in model.parameters():
        p.data.fill_(7.0)  # nothing of the previous values may survive
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # as the peer builds: the draws stay float32
    try:
        peer.fill_random(model, seed=3)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(3)
    matrices = 0
    for name, p in model.named_parameters():
        if p.dim() < 2:
            assert torch.equal(p, torch.full_like(p, 0.0 if name.endswith("bias") else 1.0))
            continue
        matrices += 1
        expected = torch.cat(
            [
                torch.empty(min(1000, p.numel() - lo)).normal_(0.0, 0.02, generator=g)
                for lo in range(0, p.numel(), 1000)
            ]
        )
        assert torch.equal(p.view(-1), expected.to(torch.float16)), name
    assert matrices == 9  # tokens, positions, q, k, v, out, fc1, fc2, the untied head
