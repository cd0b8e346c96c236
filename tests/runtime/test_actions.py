"""Each action against hand calculation, and the seeds' gradient-changing hooks."""

from __future__ import annotations

import pytest
import torch
from conftest import specs
from torch import nn

from hookrun.errors import HookrunError
from hookrun.runtime.actions import build_action
from hookrun.runtime.hooks import Recorder, attach
from hookrun.runtime.hookspec import HookConfig
from hookrun.runtime.plan import compile_plan
from hookrun.runtime.selectors import SelectConfig
from hookrun.runtime.sites import Site


class _Ctx:
    def __init__(self, seed=0):
        self.recorded = []
        self.seed = seed

    def record(self, t):
        self.recorded.append(t.clone())

    def generator(self, device):
        return torch.Generator(device=device).manual_seed(self.seed)


T = torch.tensor([-2.0, -0.5, 0.0, 1.5, 3.0])


@pytest.mark.parametrize(
    "name,args,expected",
    [
        ("scale", {"factor": 2}, [-4.0, -1.0, 0.0, 3.0, 6.0]),
        ("add", {"value": 2}, [0.0, 1.5, 2.0, 3.5, 5.0]),
        ("clamp", {"min": 0}, [0.0, 0.0, 0.0, 1.5, 3.0]),
        ("clamp", {"max": 1}, [-2.0, -0.5, 0.0, 1.0, 1.0]),
        ("clamp", {"min": -1, "max": 2}, [-1.0, -0.5, 0.0, 1.5, 2.0]),
        ("zero", {}, [0.0] * 5),
        ("capture", {}, T.tolist()),
    ],
)
def test_action_values(name, args, expected):
    ctx = _Ctx()
    out = build_action(name, args, "hooks.t").apply(T, ctx)
    assert out.tolist() == expected
    assert len(ctx.recorded) == (1 if name == "capture" else 0)


def test_noise_is_seeded_and_has_the_asked_std():
    big = torch.zeros(100_000)
    noise = build_action("noise", {"std": 0.5}, "hooks.t")
    a, b = noise.apply(big, _Ctx(1)), noise.apply(big, _Ctx(1))
    assert torch.equal(a, b)
    assert not torch.equal(a, noise.apply(big, _Ctx(2)))
    assert abs(a.std().item() - 0.5) < 0.01 and abs(a.mean().item()) < 0.01


@pytest.mark.parametrize(
    "args,match",
    [
        ({"min": 2, "max": 1}, "min 2.0 is above max 1.0"),
        ({"min": float("nan")}, "not a finite number"),
    ],
)
def test_clamp_bad_args(args, match):
    with pytest.raises(HookrunError, match=match):
        build_action("clamp", args, "hooks.t")


def test_noise_negative_std():
    with pytest.raises(HookrunError, match=r"hooks.t.args.std: -1.0 is negative"):
        build_action("noise", {"std": -1}, "hooks.t")


class _Add(nn.Module):
    def forward(self, x, y):
        return x + y


class _Mul(nn.Module):
    def forward(self, a, b):
        return a * b


class _Wrap(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op


def _hooked(model, **spec):
    hooks = {
        "h": HookConfig(
            select=SelectConfig(name="op"),
            at=Site(spec["at"]),
            action=spec["action"],
            args=spec.get("args", {}),
        )
    }
    return compile_plan(specs(hooks), model)


def test_seed_000_doubling_the_gradient_of_z():
    # z = x + y; o = w·z; the hook on z returns 2 * grad (tests/seeds/000).
    x = torch.tensor([0.0, 1, 2, 3], requires_grad=True)
    y = torch.tensor([4.0, 5, 6, 7], requires_grad=True)
    w = torch.tensor([1.0, 2, 3, 4], requires_grad=True)
    model = _Wrap(_Add())
    plan = _hooked(model, at="grad_output", action="scale", args={"factor": 2})
    recorder = Recorder(0, torch.float32)
    with attach(plan, model, recorder):
        w.matmul(model.op(x, y)).backward()
    assert x.grad.tolist() == [2, 4, 6, 8] and y.grad.tolist() == [2, 4, 6, 8]
    assert w.grad.tolist() == [4, 6, 8, 10]


def test_seed_004_adding_two_to_the_gradient_of_c():
    # c = a * b; the hook on c returns grad + 2 (tests/seeds/004).
    a = torch.tensor(7.0, requires_grad=True)
    b = torch.tensor(13.0, requires_grad=True)
    model = _Wrap(_Mul())
    plan = _hooked(model, at="grad_output", action="add", args={"value": 2})
    with attach(plan, model, Recorder(0, torch.float32)):
        model.op(a, b).backward()
    assert a.grad.item() == 39 and b.grad.item() == 21


def test_seed_002_gradient_seen_at_y():
    # y = x**2; z = mean(y): the gradient seen at y is 0.25 each (tests/seeds/002).
    class Square(nn.Module):
        def forward(self, x):
            return x**2

    x = torch.tensor([2.0, 2, 2, 2], requires_grad=True)
    model = _Wrap(Square())
    plan = _hooked(model, at="grad_output", action="capture")
    recorder = Recorder(0, torch.float32)
    with attach(plan, model, recorder):
        model.op(x).mean().backward()
    assert recorder.records["captures/op/grad_output"].tolist() == [0.25] * 4
    assert x.grad.tolist() == [1.0] * 4


def test_hooks_act_in_file_order_at_one_site():
    # scale then capture sees the doubled gradient; capture then scale sees the original.
    class Ident(nn.Module):
        def forward(self, x):
            return x * 1.0

    for order, seen in ((("s", "c"), 2.0), (("c", "s"), 1.0)):
        model = _Wrap(Ident())
        hooks = {
            "s": HookConfig(
                select=SelectConfig(name="op"),
                at=Site.grad_output,
                action="scale",
                args={"factor": 2},
            ),
            "c": HookConfig(select=SelectConfig(name="op"), at=Site.grad_output, action="capture"),
        }
        plan = compile_plan(specs({k: hooks[k] for k in order}), model)
        recorder = Recorder(0, torch.float32)
        x = torch.ones(3, requires_grad=True)
        with attach(plan, model, recorder):
            model.op(x).sum().backward()
        assert recorder.records["captures/op/grad_output"].tolist() == [seen] * 3
        assert x.grad.tolist() == [2.0] * 3
