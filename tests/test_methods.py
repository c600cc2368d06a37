"""Methods as data: a method added to eftguard.methods.METHODS alone trains through the real client and server,
uploads what its spec says, and is refused the options it does not support; nothing else names a method."""

import ast
import copy
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from eftguard import methods
from eftguard.aggregate import fedavg
from eftguard.cli import build_parser, main
from eftguard.config import TrainConfig
from eftguard.errors import ConfigError
from eftguard.federation.server import run_server
from eftguard.methods import METHODS, MethodSpec
from eftguard.rundir import RunDirectory
from eftguard.training import OptimConfig, train_local
from conftest import MICRO_PRESET, MICRO_WIDTH
from fakegrid import FakeGrid, task_identity

ROOT = Path(__file__).resolve().parents[1]
HEAD_ONLY = MethodSpec("head-only", "only the classifier head, on full images", trains=("head.",), masked=False,
                       uploads_features=False, dp_sgd=False, server_trains=False)
EFTVIT_NOMASK = dataclasses.replace(METHODS["eftvit"], name="eftvit-nomask", masked=False)
TINY = dict(model=MICRO_PRESET, clients=2, rounds=1, train_samples=60, test_samples=10, batch_size=16)


@pytest.fixture
def third_method(monkeypatch, request):
    """The spec, added to the table for this test only."""
    spec = request.param
    monkeypatch.setitem(methods.METHODS, spec.name, spec)
    return spec


def one_round(path: Path, method: str) -> RunDirectory:
    """One round on the micro ViT (the caller requests micro_preset): a method's subject is what it trains."""
    run = RunDirectory.create(path, TrainConfig(method=method, **TINY).resolved())
    with task_identity():
        run_server(FakeGrid(TINY["clients"]), run.path)
    return run


@pytest.mark.parametrize("third_method", [HEAD_ONLY], indirect=True, ids=["head-only"])
def test_a_method_added_to_the_table_trains_and_uploads_only_its_own_parameters(tmp_path, third_method, micro_preset):
    run = one_round(tmp_path / "run", third_method.name)
    record = run.metrics()[0]
    assert record["method"] == "head-only" and record["dropped"] == {}
    assert record["server_loss"] is None and record["feature_sets"] == {}
    uploads = [run.load_upload(1, k, "update") for k in range(2)]
    assert all(set(u) == {"head.weight", "head.bias"} for u in uploads)
    assert all(sorted(p.name for p in run.upload_dir(1, k).iterdir()) == ["update.safetensors"] for k in range(2))
    before, after = run.load_checkpoint(0), run.load_checkpoint(1)
    assert {k for k in after if not torch.equal(after[k], before[k])} == {"head.weight", "head.bias"}
    averaged = fedavg(uploads, [record["num_examples"][str(k)] for k in range(2)])
    assert all(torch.equal(after[k], torch.from_numpy(v)) for k, v in averaged.items())


@pytest.mark.parametrize("third_method", [EFTVIT_NOMASK], indirect=True, ids=["eftvit-nomask"])
def test_an_unmasked_feature_method_uploads_every_patch_and_the_server_trains_theta(tmp_path, third_method,
                                                                                     micro_preset):
    run = one_round(tmp_path / "run", third_method.name)
    record = run.metrics()[0]
    assert record["dropped"] == {} and record["server_loss"] > 0
    features, truth = run.load_upload(1, 0, "features"), run.load_truth(1, 0)
    assert features["features"].shape[1:] == (1 + 64, MICRO_WIDTH)  # cls + all 64 patches: nothing masked
    assert (truth["kept_ids"] == torch.arange(64).numpy()).all()
    before, after = run.load_checkpoint(0), run.load_checkpoint(1)
    assert set(run.load_upload(1, 0, "update")) == {k for k in after if k.startswith(("local_module.", "head."))}
    assert all(not torch.equal(after[k], before[k]) for k in after if k.startswith("global_module."))


def test_an_unmasked_method_trains_on_full_images_and_freezes_what_it_does_not_train(tiny_model, monkeypatch):
    model = copy.deepcopy(tiny_model)
    monkeypatch.setitem(methods.METHODS, HEAD_ONLY.name, HEAD_ONLY)
    seen = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, x, keep=None: seen.append(keep) or forward(self, x, keep))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    images = torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    train_local(model, images, torch.arange(8) % 10, HEAD_ONLY.name, 0.75, OptimConfig(1, 4, 1e-3, 0.0),
                torch.Generator().manual_seed(0))
    assert seen == [None, None]
    assert {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)} == {"head.weight", "head.bias"}
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("head."))
    assert all(p.requires_grad for p in model.parameters())  # unfrozen again for the server's training


@pytest.mark.parametrize("third_method", [HEAD_ONLY], indirect=True, ids=["head-only"])
@pytest.mark.parametrize("option, message", [
    ({"dp_eps": 1.0}, "--dp-eps: --method head-only has no DP-SGD (methods with DP-SGD: eftvit, fed-head, "
                      "fed-bias, fed-prompt, fed-lora)"),
    ({"feature_clip": 1.0}, "--method head-only uploads none"),
])
def test_options_a_method_does_not_support_are_refused_naming_it(third_method, option, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(method=third_method.name, **option).resolved()


def test_the_cli_refuses_dp_for_a_method_without_it_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "run"), "--method", "fedavg", "--dp-eps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert err.strip().splitlines()[-1] == ("eftguard: error: --dp-eps: --method fedavg has no DP-SGD "
                                            "(methods with DP-SGD: eftvit, fed-head, fed-bias, fed-prompt, "
                                            "fed-lora)")


def test_an_unknown_method_is_refused_listing_the_table():
    listed = ", ".join(METHODS)
    assert listed.startswith("eftvit, fedavg, fed-head")
    with pytest.raises(ConfigError, match=rf"^--method: unknown method 'fedprox', choose {re.escape(listed)}$"):
        methods.method_spec("fedprox")


def test_train_help_lists_every_method_with_its_description():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    help_text = " ".join(train.format_help().split())
    for name, spec in METHODS.items():
        assert f"{name} ({spec.description})" in help_text


def test_a_server_training_method_must_upload_features():
    with pytest.raises(ValueError, match="the server can train theta only on uploaded features"):
        dataclasses.replace(HEAD_ONLY, server_trains=True)


def method_name_comparisons(source: str, relative: str) -> list[str]:
    """`x == "eftvit"`, `"fedavg" != y`, `m in ("eftvit", ...)`, `case "fedavg":`."""
    found = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        literals = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [c for o in operands for c in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))]
        elif isinstance(node, ast.MatchValue):
            literals = [node.value]
        if any(isinstance(c, ast.Constant) and c.value in METHODS for c in literals):
            found.append(f"{relative}:{node.lineno} ({function})")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), None)
    return found


def test_the_comparison_finder_sees_each_form_of_branch():
    source = ('def f(m):\n    if m == "eftvit": pass\n    if "fedavg" != m: pass\n'
              '    if m in ("x", "fedavg"): pass\n    match m:\n        case "eftvit": pass\n'
              '    return m == "decoder"\n'
              'def g(m):\n    return m == "fed-lora"\n')
    assert method_name_comparisons(source, "eftguard/cli.py") == [
        "eftguard/cli.py:2 (f)", "eftguard/cli.py:3 (f)", "eftguard/cli.py:4 (f)", "eftguard/cli.py:6 (f)",
        "eftguard/cli.py:9 (g)"]


def test_no_module_branches_on_a_method_name():
    sources = [p for folder in ("eftguard", "defenses", "attacks") for p in sorted((ROOT / folder).rglob("*.py"))
               if p.name != "methods.py"]
    assert len(sources) > 20  # the walk found the package
    hits = [hit for path in sources
            for hit in method_name_comparisons(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert hits == []


def test_headprune_behaviour_is_reached_only_through_its_spec_hooks():
    """headprune-lora's pruning, upload and aggregation are hooks of its spec (eftguard.headprune.PrunedHeads):
    the client, server, bench and audit call `spec.heads.*` and never test a flag or name that says which method
    runs; its hooks object is named only by the method table."""
    sources = {p.relative_to(ROOT).as_posix(): p.read_text() for folder in ("eftguard", "defenses", "attacks")
               for p in sorted((ROOT / folder).rglob("*.py"))}
    assert not [path for path, text in sources.items() if "prunes_heads" in text]
    assert [path for path, text in sources.items() if "PRUNED_HEADS" in text] == ["eftguard/headprune.py",
                                                                                  "eftguard/methods.py"]
    pruning = [name for name, spec in METHODS.items() if spec.heads.records]
    assert pruning == ["headprune-lora"]


def test_the_heads_hooks_of_a_method_that_keeps_every_head_change_nothing():
    spec = METHODS["fed-lora"]
    model = torch.nn.Linear(2, 2)  # the hooks of ALL_HEADS never look at the model
    updates = [{"w": torch.ones(2).numpy() * k} for k in (1.0, 3.0)]
    assert spec.heads.choose(model, torch.zeros(1), "importance", 0.9, lambda: None) == (None, None)
    assert spec.heads.kept_update(updates[0], model) is updates[0]
    assert spec.heads.upload_layout(model, 0.9) == (None, None) and spec.heads.record_bytes(model) == 0
    averaged = spec.heads.average(updates, [1, 3], [None, None], "importance", {}, None, None)
    assert averaged["w"].tolist() == fedavg(updates, [1, 3])["w"].tolist() == [2.5, 2.5]
    assert spec.heads.keep_as_client(model, ["a", "b"], lambda: pytest.fail("no record is read")) == ["a", "b"]
