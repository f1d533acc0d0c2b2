"""benchmarks/peer_steps.py on stand-in peers (tests/helpers/stand_in_zo_peers/): it reads
a peer's ZO methods from its file, feeds them distzo's z, and tells agreement from a
one-line difference in the peer's step."""

import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.peer_checks import harness, zo2
from tests.helpers.scripts import benchmark_script

STAND_INS = Path(__file__).resolve().parents[1] / "helpers" / "stand_in_zo_peers"


@pytest.fixture(scope="module")
def peer_steps():
    with benchmark_script("peer_steps") as module:
        yield module


def run(peer_steps, capsys, *argv: str) -> tuple[int, str]:
    code = peer_steps.main(["--steps", "1", *argv])
    return code, capsys.readouterr().out


def test_a_faithful_peer_agrees_to_rounding(peer_steps, capsys):
    mezo, fzoo = STAND_INS / "mezo_trainer.py", STAND_INS / "fzoo_trainer.py"
    code, out = run(peer_steps, capsys, "--mezo", str(mezo), "--fzoo", str(fzoo))
    assert code == 0, out
    assert "mezo: agrees with distzo" in out and "fzoo: agrees with distzo" in out


@pytest.mark.parametrize(
    "peer, old, new",
    [
        ("mezo", "if param.data.dim() >= 2 else 0.0", "if True else 0.0"),  # biases too
        ("fzoo", "std(unbiased=False)", "std(unbiased=True)"),  # sample std, not FZOO's
        ("fzoo", "(losses - at_theta)", "(losses - perturbed[0])"),  # not L(theta)
    ],
)
def test_a_one_line_difference_in_the_peers_step_is_reported(
    peer_steps, capsys, tmp_path, peer, old, new
):
    source = (STAND_INS / f"{peer}_trainer.py").read_text()
    assert old in source
    mutant = tmp_path / harness.TRAINER_FILES[peer]
    mutant.parent.mkdir(exist_ok=True)
    mutant.write_text(source.replace(old, new))
    code, out = run(peer_steps, capsys, f"--{peer}", str(tmp_path))  # a checkout's root
    assert code == 1, out
    assert f"{peer}: DIFFERS from distzo" in out


def test_fzoos_float32_losses_are_kept_only_when_asked(peer_steps, capsys):
    fzoo = str(STAND_INS / "fzoo_trainer.py")
    code, out = run(peer_steps, capsys, "--fzoo", fzoo, "--float32-losses")
    assert code == 1 and "fzoo: DIFFERS from distzo" in out


def test_a_path_without_the_peers_trainer_is_one_line(peer_steps, tmp_path):
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo", str(tmp_path)])
    assert str(refused.value) == (
        f"--mezo {tmp_path}: no large_models/trainer.py there; give a checkout of the peer "
        "or its trainer file"
    )


def mutated(peer_steps, tmp_path: Path, peer: str, old: str, new: str) -> Path:
    """A checkout of ``peer`` whose trainer has ``old`` replaced by ``new``."""
    source = (STAND_INS / f"{peer}_trainer.py").read_text()
    assert old in source
    checkout = tmp_path / peer
    mutant = checkout / harness.TRAINER_FILES[peer]
    mutant.parent.mkdir(parents=True)
    mutant.write_text(source.replace(old, new))
    return checkout


@pytest.mark.parametrize(
    "peer, old, new, options",
    [
        ("mezo", "        return plus", "        return minus", []),  # the loss alone
        ("fzoo", "std(unbiased=False)", "std(unbiased=True)", ["--lr", "0"]),  # c alone
        # c off by 1e-8 of itself (2e-10): below an absolute 1e-9
        ("mezo", "(2 * self.args.zo_eps)", "(2.00000002 * self.args.zo_eps)", ["--lr", "0"]),
        # weights off by 1e-13 in a step of 1e-13, below 1e-9 of c, above their rounding
        ("mezo", "if param.data.dim() >= 2 else 0.0", "if True else 0.0", ["--lr", "1e-12"]),
    ],
)
def test_each_difference_counts_against_its_own_magnitude(
    peer_steps, capsys, tmp_path, peer, old, new, options
):
    checkout = mutated(peer_steps, tmp_path, peer, old, new)
    code, out = run(peer_steps, capsys, f"--{peer}", str(checkout), *options)
    assert code == 1 and f"{peer}: DIFFERS from distzo" in out, out


def test_one_differing_peer_of_two_is_exit_1(peer_steps, capsys, tmp_path):
    checkout = mutated(peer_steps, tmp_path, "mezo", "        return plus", "        return minus")
    fzoo = str(STAND_INS / "fzoo_trainer.py")
    code, out = run(peer_steps, capsys, "--mezo", str(checkout), "--fzoo", fzoo)
    assert code == 1 and "mezo: DIFFERS" in out and "fzoo: agrees" in out


def test_faithful_peers_agree_at_the_peers_own_small_learning_rate(peer_steps, capsys):
    """At MeZO's lr 1e-7 a step moves a weight by ~1e-8, whose 1e-9 is below the weights'
    own float64 rounding: a faithful peer was reported as differing."""
    mezo, fzoo = STAND_INS / "mezo_trainer.py", STAND_INS / "fzoo_trainer.py"
    argv = ["--mezo", str(mezo), "--fzoo", str(fzoo), "--lr", "1e-7", "--steps", "2"]
    code, out = run(peer_steps, capsys, *argv)
    assert code == 0, out


@pytest.mark.parametrize("peer", ["mezo", "fzoo", "zo2"])
def test_faithful_peers_agree_at_a_small_eps(peer_steps, capsys, peer):
    """At eps 1e-6 a coefficient is a loss difference of ~1e-7 over ~1e-6: the losses' own
    last place (and the weights' carried difference) is ~1e-8 of it, past rtol 1e-9, and
    the weights carry it from step to step: faithful peers were reported as differing."""
    path = {"mezo": "mezo_trainer.py", "fzoo": "fzoo_trainer.py"}
    where = STAND_INS / path[peer] if peer in path else ZO2_STAND_IN
    code, out = run(peer_steps, capsys, f"--{peer}", str(where), "--eps", "1e-6", "--steps", "3")
    assert code == 0, out


def test_a_trainer_without_the_peers_methods_is_one_line(peer_steps, tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text("class T:\n    def zo_step(self):\n        pass\n")
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo", str(trainer)])
    assert str(refused.value) == (
        f"{trainer}: class T has no zo_perturb_parameters, zo_update, zo_forward"
    )
    trainer.write_text("class T:\n    def zo_update(self):\n        pass\n")
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--mezo", str(trainer)])
    assert (
        str(refused.value) == f"{trainer}: no class defines zo_step; is it the peer's trainer.py?"
    )


def test_a_draw_of_another_parameters_shape_is_caught(peer_steps):
    """The stand-in torch serves z in the order of the model's parameters: a peer walking
    them in another order is told so, not fed one parameter's z for another."""
    z = {"a": torch.zeros(2, 3), "b": torch.ones(4)}
    noise = harness.DistzoNoise(lambda step, query: z, ["a", "b"], False)
    noise.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"^the peer drew \(4,\) where z is \(2, 3\)$"):
        noise.normal(0, 1, torch.Size([4]), dtype=torch.float64)


ZO2_STAND_IN = Path(__file__).resolve().parents[1] / "helpers" / "stand_in_zo2"


def test_zo2s_mezo_and_offload_steps_agree_with_a_faithful_stand_in(peer_steps, capsys):
    code, out = run(peer_steps, capsys, "--zo2", str(ZO2_STAND_IN), "--steps", "2")
    assert code == 0, out
    assert "zo2-mezo: agrees with distzo" in out and "zo2-offload: agrees with distzo" in out


@pytest.mark.parametrize(
    "file, old, new, offload",
    [  # step 1's pass applies step 0's update: two steps
        ("mezo_sgd/zo2.py", "if projected_grad != 0:", "if False:", True),  # never applied
        ("mezo_sgd/zo2.py", "set_rng_state(self.last_rstate)", "set_rng_state(self.rstate)", True),
        ("mezo_sgd/zo.py", '"layer_norm", ', "", False),  # layer norm scales decayed
    ],
)
def test_a_one_line_difference_in_zo2s_step_is_reported(
    peer_steps, capsys, tmp_path, file, old, new, offload
):
    checkout = tmp_path / "zo2"
    shutil.copytree(ZO2_STAND_IN, checkout)
    mutated = checkout / "zo2" / "optimizer" / file
    source = mutated.read_text()
    assert old in source
    mutated.write_text(source.replace(old, new))
    args = peer_steps.parse_args(["--zo2", str(checkout), "--steps", "2"])
    assert not zo2.compare_zo2(checkout, offload, args)
    label = "zo2-offload" if offload else "zo2-mezo"
    assert f"{label}: DIFFERS from distzo" in capsys.readouterr().out


QWEN3_NORMS = {
    f"model.layers.{i}.self_attn.{norm}.weight" for i in (0, 1) for norm in ("q_norm", "k_norm")
} | {"model.norm.weight"}


def apart_in(out: str) -> list[list[str]]:
    """Each "differs most in" line's tensor names, largest difference first."""
    lines = [line.split(": ", 1)[1] for line in out.splitlines() if "differs most in" in line]
    return [[part.split()[0] for part in line.split(", ")] for line in lines]


def test_zo2s_qwen3_steps_agree_with_a_faithful_stand_in(peer_steps, capsys):
    """Without weight decay ZO2's Qwen3 units (read from its model file) draw every
    untied tensor once: both its modes take distzo's steps."""
    argv = ("--zo2", str(ZO2_STAND_IN), "--family", "qwen3", "--weight-decay", "0")
    code, out = run(peer_steps, capsys, *argv)
    assert code == 0, out
    assert "zo2-mezo: agrees with distzo" in out and "zo2-offload: agrees with distzo" in out


def test_zo2s_decay_by_name_reaches_qwen3s_q_norm_k_norm_and_final_norm(peer_steps, capsys):
    """ZO2 spares names holding bias/layer_norm/layernorm/ln: Qwen3's q_norm, k_norm and
    final norm decay there, not in distzo (1-D), and the check names exactly those."""
    args = peer_steps.parse_args(["--zo2", str(ZO2_STAND_IN), "--family", "qwen3", "--steps", "1"])
    assert not zo2.compare_zo2(ZO2_STAND_IN, False, args)
    apart = apart_in(capsys.readouterr().out)
    assert apart and all(set(names) == QWEN3_NORMS for names in apart), apart


def test_zo2s_offload_gives_a_tied_head_a_z_of_its_own(peer_steps, capsys):
    """The tied head is a unit of its own in ZO2's offload: drawn again (a second z) and
    updated again; ZO2's MeZO step, which walks the model's parameters, draws it once."""
    argv = ["--zo2", str(ZO2_STAND_IN), "--family", "qwen3", "--zo2-tied", "--weight-decay", "0"]
    args = peer_steps.parse_args([*argv, "--steps", "2"])
    assert zo2.compare_zo2(ZO2_STAND_IN, False, args)
    capsys.readouterr()
    assert not zo2.compare_zo2(ZO2_STAND_IN, True, args)
    out = capsys.readouterr().out
    assert "differs most in: no tensor yet (the loss and g differ)" in out  # step 0: g
    assert apart_in(out)[-1][0] == "model.embed_tokens.weight"  # step 1: the tied matrix


QWEN3_MODEL = Path("model", "huggingface", "qwen3", "mezo_sgd", "zo2.py")


def test_a_one_line_decay_in_zo2s_qwen3_units_is_reported(peer_steps, capsys, tmp_path):
    """A weight decay of the head's own in ZO2's Qwen3 model file reaches its update."""
    checkout = tmp_path / "zo2"
    shutil.copytree(ZO2_STAND_IN, checkout)
    mutated = checkout / "zo2" / QWEN3_MODEL
    old = '{"input": hidden[1]},'
    assert old in mutated.read_text()
    mutated.write_text(mutated.read_text().replace(old, old + " weight_decay=0.1,"))
    argv = ["--zo2", str(checkout), "--family", "qwen3", "--weight-decay", "0", "--steps", "2"]
    assert not zo2.compare_zo2(checkout, True, peer_steps.parse_args(argv))
    out = capsys.readouterr().out
    assert "zo2-offload: DIFFERS from distzo" in out
    assert apart_in(out)[-1] == ["lm_head.weight"]


def test_a_norm_zo2s_qwen3_units_skip_is_named(peer_steps, tmp_path):
    checkout = tmp_path / "zo2"
    shutil.copytree(ZO2_STAND_IN, checkout)
    mutated = checkout / "zo2" / QWEN3_MODEL
    source = mutated.read_text()
    assert "module=self.model.norm," in source
    mutated.write_text(source.replace("module=self.model.norm,", "module=self.model.rotary_emb,"))
    args = peer_steps.parse_args(["--zo2", str(checkout), "--family", "qwen3"])
    with pytest.raises(SystemExit) as refused:
        zo2.compare_zo2(checkout, True, args)
    assert str(refused.value) == "ZO2's units miss ['model.norm.weight']"


def test_a_checkout_without_zo2s_qwen3_code_is_refused_before_any_run(peer_steps, capsys, tmp_path):
    checkout = tmp_path / "zo2"
    shutil.copytree(ZO2_STAND_IN, checkout)
    (checkout / "zo2" / QWEN3_MODEL).unlink()
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--zo2", str(checkout), "--family", "qwen3"])
    assert str(refused.value) == (
        f"--zo2 {checkout}: no zo2/{QWEN3_MODEL.as_posix()} there; give a clone of liangyuwang/zo2"
    )
    assert capsys.readouterr().out == ""  # no step of either mode ran


def test_zo2_checks_only_the_races_families(peer_steps, capsys):
    with pytest.raises(SystemExit):
        peer_steps.parse_args(["--zo2", str(ZO2_STAND_IN), "--family", "llama"])
    assert "--zo2 checks --family opt or qwen3 (the race's), not llama" in capsys.readouterr().err


def test_a_path_without_zo2s_optimizer_is_refused_before_any_run(peer_steps, tmp_path):
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--zo2", str(tmp_path)])
    assert str(refused.value) == (
        f"--zo2 {tmp_path}: no zo2/optimizer/base.py there; give a clone of liangyuwang/zo2"
    )


ZOBENCH_STAND_IN = STAND_INS / "zobench_trainer.py"
MOMENTUM_RUNS = ("zobench-momentum (stored)", "zobench-momentum (recomputed)")
ADAM_RUNS = ("zobench-adam",)
ZOBENCH_RUNS = (*MOMENTUM_RUNS, *ADAM_RUNS)


def test_zobenchs_momentum_and_adam_agree_with_a_faithful_stand_in(peer_steps, capsys):
    """Adam's eps at 1e-30: what is left is the algorithm, with eps's placement gone."""
    argv = ["--zobench", str(ZOBENCH_STAND_IN), "--steps", "2", "--adam-eps", "1e-30"]
    code, out = run(peer_steps, capsys, *argv)
    assert code == 0, out
    assert all(f"{label}: agrees with distzo" in out for label in ZOBENCH_RUNS), out


def test_zobenchs_adam_differs_by_where_eps_is_added(peer_steps, capsys):
    """torch's Adam adds eps to sqrt(v / (1 - beta2^t)), distzo's (transformers' AdamW,
    MeZO's) to sqrt(v): at torch's default eps the check reports it (docs/optimizers.md)."""
    code, out = run(peer_steps, capsys, "--zobench", str(ZOBENCH_STAND_IN))
    assert code == 1, out
    assert "zobench-adam: DIFFERS from distzo" in out
    assert "zobench-momentum (stored): agrees" in out
    assert "zobench-momentum (recomputed): agrees" in out


@pytest.mark.parametrize(
    "old, new, options, differing",
    [  # torch's SGD dampens from its second step on: two steps
        ("momentum=args.momentum", "momentum=args.momentum, dampening=0.9", [], MOMENTUM_RUNS),
        ("lr=args.learning_rate)", "lr=args.learning_rate, weight_decay=0.1)", [], ADAM_RUNS),
        ("z / self.args.q", "z", ["--zobench-queries", "2"], MOMENTUM_RUNS),  # sum, not mean
    ],
)
def test_a_one_line_difference_in_zobenchs_step_is_reported(
    peer_steps, capsys, tmp_path, old, new, options, differing
):
    source = ZOBENCH_STAND_IN.read_text()
    assert source.count(old) == 1
    mutant = tmp_path / "zo-bench" / "trainer.py"
    mutant.parent.mkdir()
    mutant.write_text(source.replace(old, new))
    argv = ["--zobench", str(tmp_path), "--steps", "2", "--adam-eps", "1e-30", *options]
    code, out = run(peer_steps, capsys, *argv)
    assert code == 1, out
    for label in ZOBENCH_RUNS:
        verdict = "DIFFERS from" if label in differing else "agrees with"
        assert f"{label}: {verdict} distzo" in out, out


def test_a_trainer_without_zobenchs_optimizer_set_up_is_one_line(peer_steps, tmp_path):
    trainer = tmp_path / "trainer.py"
    source = ZOBENCH_STAND_IN.read_text()
    trainer.write_text(source.replace('args.trainer == "zo_adam"', 'args.trainer == "adam"'))
    with pytest.raises(SystemExit) as refused:
        peer_steps.main(["--zobench", str(trainer)])
    assert str(refused.value) == (
        f"{trainer}: class OurTrainer builds no optimizer for zo_adam in "
        "_inner_training_loop; is it ZO-Bench's zo-bench/trainer.py?"
    )
