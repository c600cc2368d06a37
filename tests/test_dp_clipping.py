"""DP-SGD's per-sample clipping (eftguard.defenses.clipping.PerSampleClipping): the clipped gradient sum against a
one-sample-at-a-time reference, the cost of getting it (the frozen global module is traversed once), and the layers it refuses."""

import copy

import pytest
import torch
from torch import nn

from conftest import MICRO_PRESET, images_and_labels
from eftguard.defenses.clipping import make_private
from eftguard.defenses.dp import DPSGD
from eftguard.bench import count_flops
from eftguard.masking import random_keep_ids
from eftguard.methods import METHODS
from eftguard.model import build_model
from eftguard.training import OptimConfig, train_local

BATCH = 4


def seeded_batch(masked: bool):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (BATCH, 32, 32, 3), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (BATCH,), generator=g)
    return images, labels, random_keep_ids(BATCH, 64, 0.75, g) if masked else None


def one_sample_at_a_time(model, x, labels, keep, trained):
    """Brute force: each sample's gradient of its own loss, one forward and backward per sample."""
    grads = []
    for i in range(len(labels)):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[i:i + 1], None if keep is None else keep[i:i + 1]),
                                    labels[i:i + 1]).backward()
        grads.append({name: p.grad.clone() for name, p in trained})
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("method", ["eftvit", "fedavg"])
def test_the_clipped_gradient_sum_is_the_sum_of_each_samples_clipped_gradient(micro_preset, method):
    """eftvit: phi and h trained on masked images through the frozen theta; fedavg's case: every parameter trained,
    so the gradient flows from the loss through the whole model. The clip lies between the middle two of the four
    per-sample norms (over all trained parameters jointly): two samples are clipped, two are not. In float64, so
    that the batched and the one-sample computations agree to rounding far below any real error (float32's differ by
    up to 6e-7 of a gradient's largest entry)."""
    spec = METHODS[method]
    torch.set_default_dtype(torch.float64)  # put back after the test (conftest)
    model = build_model(MICRO_PRESET, 10, 2, seed=0).train()
    for name, p in model.named_parameters():
        p.requires_grad_(spec.trains_parameter(name))
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    images, labels, keep = seeded_batch(spec.masked)
    x = model.normalize(images).double()
    reference = one_sample_at_a_time(model, x, labels, keep, trained)
    norms = torch.stack([sum((g * g).sum() for g in r.values()).sqrt() for r in reference])
    clip = float(norms.sort().values[1:3].mean())
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)  # opacus' clipping factor, as eftguard.defenses.dp
    assert (factors < 1).sum() == 2

    optimizer = torch.optim.SGD([p for _, p in trained], lr=0.0)
    wrapped, dp_optimizer, criterion, _ = make_private(model, optimizer, DPSGD(0.0, clip, 1.0, 0), BATCH)
    try:
        criterion(wrapped(x, keep), labels).backward()
        clipped_sums = {name: p.grad.clone() for name, p in trained}
        dp_optimizer.step()
    finally:
        wrapped.to_standard_module()
    for name, p in trained:
        expected = sum(r[name] * f for r, f in zip(reference, factors))
        torch.testing.assert_close(clipped_sums[name], expected, rtol=1e-9, atol=1e-12, msg=name)
        assert torch.equal(p.grad, clipped_sums[name] / BATCH), name  # zero noise: the sum over the batch size


def eftvit_dp_step(model, dp: bool):
    images, labels, _ = seeded_batch(masked=False)
    return train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, BATCH, 1e-3, 0.0),
                       torch.Generator().manual_seed(0), dp=DPSGD(1.0, 1.0, 1.0, 0) if dp else None)


def test_a_dp_step_backpropagates_through_the_frozen_global_module_once(micro_preset):
    """Ghost clipping's second backward pass, of sum_i c_i loss_i from the loss, went through theta again; now the
    clipped sums start at the trained layers' outputs."""
    model = build_model(MICRO_PRESET, 10, 2, seed=0)
    backward_calls = []
    model.global_module.blocks[0].register_full_backward_hook(lambda *args: backward_calls.append(1))
    eftvit_dp_step(model, dp=False)
    assert len(backward_calls) == 1
    eftvit_dp_step(model, dp=True)
    assert len(backward_calls) == 2


def test_a_dp_step_costs_few_more_flops_than_a_plain_step(tiny_model):
    """vit-tiny-32, M = 2, r_m 0.75 (the bench's eftvit row): ghost clipping cost 1.56x a plain step's FLOPs (its
    second pass through theta); the per-sample norms and clipped sums add the phi-sized work only."""
    plain = count_flops(lambda: eftvit_dp_step(tiny_model, dp=False))
    private = count_flops(lambda: eftvit_dp_step(tiny_model, dp=True))
    assert plain < private < 1.25 * plain


def clip_one_batch(model: nn.Module):
    x, labels = torch.randn(BATCH, 4), torch.arange(BATCH) % 2
    wrapped, _, criterion, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                            DPSGD(0.0, 1.0, 1.0, 0), BATCH)
    try:
        criterion(wrapped(x), labels).backward()
    finally:
        wrapped.to_standard_module()


def test_a_layer_that_runs_twice_is_refused():
    """Its per-sample norm would be two norms instead of the norm of the sum."""
    shared = nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match=r"^DP-SGD: Linear ran twice in one step; per-sample clipping does "
                                                  r"not support a layer used twice \(shared parameters\)$"):
        clip_one_batch(nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 2)))


def test_a_layer_output_changed_in_place_is_refused():
    """An in-place ReLU rewrites the Linear's output: the gradient read there would be the ReLU output's."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="^DP-SGD: the output of Linear was changed in place after the layer ran, "
                                           "so its gradient cannot be read off; make that operation out of place$"):
        clip_one_batch(model)
    assert all(p.grad is None for p in model.parameters())


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.head = nn.MultiheadAttention(4, 1, batch_first=True), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.unsqueeze(1)
        return self.head(self.attention(tokens, tokens, tokens)[0][:, 0])


def test_a_trained_layer_that_returns_a_tuple_is_refused():
    """torch's MultiheadAttention returns (output, weights): no single output gradient to read per sample."""
    with pytest.raises(NotImplementedError, match=r"^DP-SGD: MultiheadAttention returns a tuple, per-sample clipping "
                                                  "needs trained layers that return one tensor$"):
        clip_one_batch(SelfAttention())


class SharedTokens(nn.Module):
    """A learned offset returned without a batch dimension and broadcast by the caller: the gradient at its
    output is summed over the batch, so no per-sample norm can be read off it."""

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.offset


class WithSharedTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.tokens = nn.Linear(4, 2), SharedTokens()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.tokens(x)


def test_a_layer_output_without_the_batch_dimension_first_is_refused():
    with pytest.raises(NotImplementedError, match=r"^DP-SGD: SharedTokens maps \(4, 4\) to \(1, 2\) for 4 samples; "
                                                  "per-sample clipping needs trained layers whose input and output "
                                                  "have the batch dimension first$"):
        clip_one_batch(WithSharedTokens())


def test_dp_training_clips_linear_layers_by_ghost_norms_without_per_sample_gradients(tiny_model, monkeypatch):
    """Per-sample clipping (what training uses) computes a Linear layer's per-sample gradient norms directly; the
    other layers get a batch of per-sample gradients per parameter (batch-size times the memory)."""
    from eftguard.defenses import clipping

    materialised = []
    original = clipping._per_sample_gradients
    monkeypatch.setattr(clipping, "_per_sample_gradients",
                        lambda layer, *args: materialised.append(layer) or original(layer, *args))
    model = copy.deepcopy(tiny_model)
    images, labels = images_and_labels(4)
    train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 4, 1e-3, 0.0),
                torch.Generator().manual_seed(0), dp=DPSGD(1.0, 1.0, 1.0, 0))
    linear = [m for m in model.modules() if type(m) is nn.Linear and any(p.requires_grad for p in m.parameters())]
    assert len(linear) > 2 and materialised  # the layer norms still get per-sample gradients
    assert not any(type(layer) is nn.Linear for layer in materialised)


class ScaleWithSpare(nn.Module):
    """A layer no ghost norm or opacus sampler knows (torch.func computes its per-sample gradients), with a trained
    parameter its forward never uses."""

    def __init__(self):
        super().__init__()
        self.weight, self.spare = nn.Parameter(torch.linspace(0.5, 1.5, 4)), nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class WithUnusedHead(nn.Module):
    """A trained auxiliary head computed in every forward but left out of the loss (as a distillation head is)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.scale, self.head, self.aux = nn.Linear(4, 4), ScaleWithSpare(), nn.Linear(4, 2), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.scale(torch.tanh(self.first(x)))
        self.aux(hidden)
        return self.head(hidden)


def clipped_sum_by_brute_force(model: nn.Module, batches, clip: float) -> dict[str, torch.Tensor]:
    """Each sample's gradient over every trained parameter jointly, clipped to `clip`, summed over all batches."""
    total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for x, labels in batches:
        for i in range(len(labels)):
            loss = nn.functional.cross_entropy(model(x[i:i + 1]), labels[i:i + 1])
            grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True, materialize_grads=True)
            factor = min(1.0, clip / (float(torch.cat([g.flatten() for g in grads]).norm()) + 1e-6))
            for (name, _), g in zip(model.named_parameters(), grads):
                total[name] += factor * g
    return total


def toy_batches(count: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (BATCH,), generator=g))
            for _ in range(count)]


def test_backward_twice_before_a_step_adds_both_clipped_sums_and_unused_parameters_get_zeros():
    """Gradient accumulation over two batches (each batch's hooks captured afresh, none captured while torch.func
    reruns a layer), a layer on the torch.func path, a trained head left out of the loss and a parameter its layer
    never uses: every trained parameter ends with the brute-force clipped sum, zeros where it had no gradient."""
    torch.set_default_dtype(torch.float64)  # put back after the test (conftest)
    model = WithUnusedHead().double().train()
    batches, clip = toy_batches(2), 0.05
    expected = clipped_sum_by_brute_force(model, batches, clip)
    wrapped, _, criterion, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                            DPSGD(0.0, clip, 1.0, 0), BATCH)
    try:
        for x, labels in batches:
            criterion(wrapped(x), labels).backward()
    finally:
        wrapped.to_standard_module()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
    assert not model.aux.weight.grad.any() and not model.scale.spare.grad.any()
    assert expected["scale.weight"].any() and expected["first.weight"].any()


def test_forward_in_eval_mode_or_without_grad_is_not_clipped():
    """An evaluation between steps (no_grad, or eval mode) is no training step: it is not captured, and a backward
    after eval-mode forwards alone is refused rather than read as an empty step."""
    torch.set_default_dtype(torch.float64)  # put back after the test (conftest)
    model = WithUnusedHead().double().train()
    [(x, labels)], clip = toy_batches(1), 0.05
    expected = clipped_sum_by_brute_force(model, [(x, labels)], clip)
    wrapped, _, criterion, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                            DPSGD(0.0, clip, 1.0, 0), BATCH)
    try:
        with torch.no_grad():
            wrapped(x)
        loss = criterion(wrapped(x), labels)
        model.eval()
        wrapped(x)
        loss.backward()
        torch.testing.assert_close(model.head.weight.grad, expected["head.weight"], rtol=1e-9, atol=1e-12)
        with pytest.raises(RuntimeError, match=r"^DP-SGD: no trained layer ran in training mode since the last step; "
                                               r"call the wrapped model in train mode before each backward\(\)$"):
            criterion(wrapped(x), labels).backward()
    finally:
        wrapped.to_standard_module()
