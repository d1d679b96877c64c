"""Each torch private name bfexp.torch_internals uses still exists and still means what bfexp reads it for.

torch may rename or drop any of them in a release; these tests fail naming the torch attribute, and
check the behaviour through torch's public API (hooks registered with ``register_*_hook``, an optimizer
stepped as torch steps it, ``import torch._dynamo``).
"""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.optim.optimizer as torch_optimizer

from bfexp import torch_internals
from bfexp.algorithms import DSGD
from bfexp.comm.threads import ThreadsEngine, ThreadWorld
from bfexp.topology import Ring


def _sgd() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)


class _Bare(torch.optim.Optimizer):
    """An Optimizer whose __init__ does not run torch's (as a DecentralizedOptimizer)."""

    def __init__(self) -> None:
        self.param_groups, self.state, self.defaults = [], {}, {}
        torch_internals.add_hook_tables(self)

    def step(self, closure=None):  # noqa: ANN001, ANN201
        return None


def test_optimizer_init_makes_the_hook_tables_bfexp_makes():
    made = {k for k in vars(_sgd()) if k.startswith("_optimizer_") and k.endswith("_hooks")}
    assert made == set(torch_internals.HOOK_TABLES), (
        f"torch.optim.Optimizer.__init__ now makes the hook tables {sorted(made)}, bfexp.torch_internals.HOOK_TABLES "
        f"says {sorted(torch_internals.HOOK_TABLES)}: a DecentralizedOptimizer (whose __init__ is not torch's) "
        "would lack the new ones")


@pytest.mark.parametrize("register", ["register_step_pre_hook", "register_step_post_hook",
                                      "register_state_dict_pre_hook", "register_state_dict_post_hook",
                                      "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook"])
def test_every_public_hook_registration_works_on_an_optimizer_given_the_tables(register):
    optimizer = _Bare()
    method = getattr(optimizer, register, None)
    assert method is not None, f"torch.optim.Optimizer.{register} is gone"
    try:
        handle = method(lambda *args: None)
    except AttributeError as e:
        pytest.fail(f"torch.optim.Optimizer.{register} needs a table bfexp.torch_internals.add_hook_tables "
                    f"does not make: {e}")
    handle.remove()


@pytest.mark.parametrize("name", ["_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"])
def test_the_global_step_hook_tables_exist(name):
    table = getattr(torch_optimizer, name, None)
    assert isinstance(table, dict), (f"torch.optim.optimizer.{name} is gone (or no longer a dict): "
                                     "bfexp.torch_internals.step_pre_hooks/step_post_hooks read it")


@pytest.mark.parametrize("own", ["_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"])
def test_register_step_hook_fills_the_table_torch_internals_reads(own):
    optimizer = _Bare()
    register = optimizer.register_step_pre_hook if "pre" in own else optimizer.register_step_post_hook
    handle = register(lambda *args: None)
    try:
        assert len(getattr(optimizer, own)) == 1, f"Optimizer.{register.__name__} no longer fills Optimizer.{own}"
    finally:
        handle.remove()


def test_step_hooks_are_reported_in_the_order_torch_runs_them():
    """A real torch optimizer's step runs its hooks (its own and the global ones) in some order;
    step_pre_hooks / step_post_hooks report the same hooks in the same order."""
    optimizer = _sgd()
    ran: list[str] = []

    def hook(label: str):  # noqa: ANN202
        def call(*args: object) -> None:
            ran.append(label)
        call.label = label
        return call

    assert torch_internals.step_pre_hooks(optimizer) == () and torch_internals.step_post_hooks(optimizer) == ()
    handles = [optimizer.register_step_pre_hook(hook("own pre")),
               torch_optimizer.register_optimizer_step_pre_hook(hook("global pre")),
               optimizer.register_step_post_hook(hook("own post")),
               torch_optimizer.register_optimizer_step_post_hook(hook("global post"))]
    try:
        optimizer.step()
        reported = [h.label for h in (*torch_internals.step_pre_hooks(optimizer),
                                      *torch_internals.step_post_hooks(optimizer))]
    finally:
        for h in handles:
            h.remove()
    assert reported == ran, (f"torch runs step hooks as {ran}; bfexp.torch_internals reports {reported} "
                             "(torch.optim.Optimizer.profile_hook_step changed its order)")
    assert torch_internals.step_pre_hooks(optimizer) == () and torch_internals.step_post_hooks(optimizer) == ()


def test_a_decentralized_optimizer_runs_the_hooks_registered_through_torch():
    model = torch.nn.Linear(3, 1)
    opt = DSGD(torch.optim.SGD(model.parameters(), lr=0.1), ThreadsEngine(ThreadWorld(1), 0), Ring(1), model=model)
    ran: list[tuple[str, object, object]] = []

    def hook(label: str):  # noqa: ANN202
        def call(o: object, args: tuple, kwargs: dict) -> None:
            if o is opt:  # the global ones also see the local SGD's own step
                ran.append((label, args, kwargs))
        return call

    handles = [opt.register_step_pre_hook(hook("own pre")),
               torch_optimizer.register_optimizer_step_pre_hook(hook("global pre")),
               opt.register_step_post_hook(hook("own post")),
               torch_optimizer.register_optimizer_step_post_hook(hook("global post"))]
    try:
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    finally:
        for h in handles:
            h.remove()
    assert ran == [(label, (None,), {}) for label in ("global pre", "own pre", "own post", "global post")]


DYNAMO_CHECK = textwrap.dedent("""
    import sys
    import torch
    import torch.optim.optimizer as torch_optimizer
    from bfexp.torch_internals import defer_dynamo, DYNAMO_WRAPPED, DYNAMO_DISABLE_CACHE

    def say(problem):
        print("PROBLEM: " + problem)
        sys.exit(0)

    if "torch._dynamo" in sys.modules:
        say("importing torch already imports torch._dynamo: defer_dynamo has nothing left to spare")
    use_grad = getattr(torch_optimizer, "_use_grad_for_differentiable", None)
    if use_grad is None:
        say("torch.optim.optimizer._use_grad_for_differentiable is gone: defer_dynamo no longer recognises "
            "torch's optimizer code and defers nothing")
    for name in DYNAMO_WRAPPED:
        if getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None) is None:
            say(f"torch.optim.Optimizer.{name} is no longer wrapped (no __wrapped__): update DYNAMO_WRAPPED")
    defer_dynamo()
    if type(sys.modules.get("torch._dynamo")).__name__ != "_DeferredDynamo":
        say("defer_dynamo put no stand-in for torch._dynamo (torch.optim.optimizer._use_grad_for_differentiable "
            "no longer calls torch._dynamo.graph_break?)")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    if "torch._dynamo.eval_frame" in sys.modules:
        say(f"an optimizer's step, zero_grad, state_dict or add_param_group imported the real torch._dynamo: "
            f"torch's _disable_dynamo wrapper no longer caches on {DYNAMO_DISABLE_CACHE!r}, or step asks "
            f"torch._dynamo for more than graph_break")
    if not torch.equal(p.detach(), torch.full((3,), 0.9)):
        say(f"an optimizer step under the stand-in gave {p.tolist()}")
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counted:
        torch.nn.Linear(4, 3)(torch.ones(2, 4))
    if "torch._dynamo.eval_frame" in sys.modules:
        say("torch's FlopCounterMode imported the real torch._dynamo: its __torch_dispatch__ is no longer "
            f"wrapped as DYNAMO_WRAPPED_MODES says, or its wrapper no longer caches on {DYNAMO_DISABLE_CACHE!r}")
    if counted.get_total_flops() != 2 * 2 * 4 * 3:  # a (2x4) @ (4x3) product: 24 multiply-adds
        say(f"FlopCounterMode under the stand-in counted {counted.get_total_flops()} FLOPs, not 48")
    hasattr(sys.modules["torch._dynamo"], "__file__")  # inspect.getmodule asks every module (torch.library does)
    if "torch._dynamo.eval_frame" in sys.modules:
        say("a module dunder the stand-in lacks (__file__) imported the real torch._dynamo (inspect.getmodule, "
            "in the middle of another import: a circular import of torch.distributed.tensor)")
    import torch.distributed.tensor  # noqa: F401  imports torch.library ops while the stand-in is in place
    disable = torch._dynamo.disable  # anything else: the real module takes the stand-in's place
    import torch._dynamo.utils  # noqa: F401  a submodule loads once
    if type(sys.modules["torch._dynamo"]).__name__ == "_DeferredDynamo" or not callable(disable):
        say("asking the stand-in for more than graph_break did not load the real torch._dynamo")
    if torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1)).item() != 2.0:
        say("torch.compile after the stand-in gave a wrong result")
    print("OK")
""")


def test_defer_dynamo_spares_the_import_and_gives_the_real_module_when_asked():
    """In a fresh interpreter (this one may have torch._dynamo loaded already)."""
    out = subprocess.run([sys.executable, "-c", DYNAMO_CHECK], capture_output=True, text=True, timeout=300)
    if not out.stdout.strip().endswith("OK"):
        pytest.fail(out.stdout + out.stderr, pytrace=False)
