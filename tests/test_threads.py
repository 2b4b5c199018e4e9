"""One patched model, several threads: each thread's forward gives exactly what it gives alone.

The races are made reproducible: `Lockstep` runs one thread at a time and may hand the turn over at every
private attribute access of the rotary module and before every decoder layer, as a seeded coin says, so a state
that one thread writes and another reads between two of those points shows up on every run, not once in a
thousand. (The dynamic cases failed on the rotary module that kept its length and frequencies in separate
attributes.)
"""

import random
import threading
from contextlib import contextmanager, nullcontext

import pytest
import torch

import ctxext
from tests.helpers import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
L = 16  # the tiny models' original length: both threads' lengths lie past it
WAIT_S = 60.0


class Lockstep:
    """Threads that take turns, one running at a time: at each `step()` the running thread hands the turn to the
    next thread inside `running()`, or not, as a seeded coin says, and waits for it to come back. The first turn
    starts once `parties` threads are inside; a thread left alone goes straight on. Which thread runs when is
    therefore the same on every run (a schedule drawn at random once, by the seed)."""

    def __init__(self, parties: int, seed: int = 0, handover: float = 0.5):
        self.condition = threading.Condition()
        self.parties = parties
        self.coin = random.Random(seed)
        self.handover = handover
        self.active: list[int] = []
        self.turn: int | None = None

    @contextmanager
    def running(self):
        me = threading.get_ident()
        with self.condition:
            self.active.append(me)
            if len(self.active) == self.parties:
                self.turn = self.active[0]
                self.condition.notify_all()
            self._wait_for_turn(me)
        try:
            yield
        finally:
            with self.condition:
                index = self.active.index(me)
                self.active.remove(me)
                self.turn = self.active[index % len(self.active)] if self.active else None
                self.condition.notify_all()

    def step(self) -> None:
        me = threading.get_ident()
        with self.condition:
            if me not in self.active or len(self.active) == 1 or self.coin.random() >= self.handover:
                return
            self.turn = self.active[(self.active.index(me) + 1) % len(self.active)]
            self.condition.notify_all()
            self._wait_for_turn(me)

    def _wait_for_turn(self, me: int) -> None:
        if not self.condition.wait_for(lambda: self.turn == me, timeout=WAIT_S):
            raise TimeoutError("lockstep: the other thread never handed the turn back")


def interleave_rotary(model, lockstep: Lockstep) -> None:
    """Hand the turn over at every read and write of the rotary module's private attributes (its caches)."""
    rotary = model.model.rotary_emb
    base = type(rotary)

    class Interleaved(base):
        def __getattribute__(self, name):
            if name.startswith("_") and not name.startswith("__"):
                lockstep.step()
            return base.__getattribute__(self, name)

        def __setattr__(self, name, value):
            lockstep.step()
            base.__setattr__(self, name, value)
            lockstep.step()

    rotary.__class__ = Interleaved


def interleave_layers(model, lockstep: Lockstep) -> None:
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: lockstep.step())


def run_in_threads(model, inputs: list[torch.Tensor], rounds: int, lockstep: Lockstep | None = None):
    """Each input in a thread of its own, `rounds` forwards each, all on `model` at once: every thread's logits."""
    outputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(inputs))}
    errors: list[BaseException] = []
    start = threading.Barrier(len(inputs))

    def work(index: int) -> None:
        try:
            start.wait(timeout=WAIT_S)
            with torch.no_grad(), lockstep.running() if lockstep else nullcontext():
                for _ in range(rounds):
                    outputs[index].append(model(inputs[index]).logits)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10 * WAIT_S)
    assert not errors, errors
    assert all(len(logits) == rounds for logits in outputs.values()), "a thread did not finish"
    return outputs


def single_threaded(model, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x).logits for x in inputs]


def token_rows(*lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (1, n), generator=generator) for n in lengths]


@pytest.mark.parametrize(
    "method,params",
    [
        ("dynamic_ntk", {"factor": 4}),
        ("yarn", {"factor": 4, "dynamic": True}),
        ("self_extend", {"factor": 4, "group_size": 2, "window": 6, "logn": True}),
        ("dynamic_ntk", {"factor": 4, "logn": True}),
    ],
    ids=["dynamic_ntk", "dynamic_yarn", "self_extend+logn", "dynamic_ntk+logn"],
)
def test_threads_at_different_lengths_get_their_own_results(method, params):
    """A dynamic method's frequencies and a remapping method's forward plan follow each thread's own length.

    The reference: the same model run alone, input by input."""
    model = ctxext.patch(tiny_model("llama", max_position_embeddings=L), method, **params)
    inputs = token_rows(24, 50)
    expected = single_threaded(model, inputs)
    assert not torch.allclose(expected[1][:, :24], expected[0], atol=1e-4)  # the lengths do change the result
    lockstep = Lockstep(parties=len(inputs))
    interleave_rotary(model, lockstep)
    interleave_layers(model, lockstep)
    outputs = run_in_threads(model, inputs, rounds=8, lockstep=lockstep)
    for index, logits in outputs.items():
        for got in logits:
            assert torch.equal(got, expected[index]), (method, index, (got - expected[index]).abs().max())


def test_threads_running_freely_match_the_single_threaded_results():
    """The same without a scheduler (the interpreter's own thread switches), many forwards per thread."""
    model = ctxext.patch(tiny_model("qwen2", max_position_embeddings=L), "dynamic_ntk", factor=4, logn=True)
    inputs = token_rows(20, 33, 47)
    expected = single_threaded(model, inputs)
    outputs = run_in_threads(model, inputs, rounds=25)
    for index, logits in outputs.items():
        assert all(torch.equal(got, expected[index]) for got in logits), index
