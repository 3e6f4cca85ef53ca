"""Kernel switches belong to the engine whose work runs (core/kernel_options.py): each
engine's start-up and steps see its own, everything else the process default, and the
kernels' own setters change only that default."""

from __future__ import annotations

import threading

import pytest

from specserve import LLM, SamplingParams
from specserve.core import kernel_options
from specserve.core.kernel_options import KernelOptions, current, set_default, using


def test_using_scopes_the_options_and_restores_the_default():
    default = current()
    mine = KernelOptions(pdl=False, argmax="off", stream_k=True, stage_kernel=False)
    with using(mine):
        assert current() is mine
        with using(KernelOptions()):
            assert current() == KernelOptions()
        assert current() is mine
        seen = []
        worker = threading.Thread(target=lambda: seen.append(current()))
        worker.start()
        worker.join()
        assert seen == [default]  # a new thread starts from the default
    assert current() is default
    with pytest.raises(ValueError, match="argmax mode"):
        KernelOptions(argmax="on")


def test_the_kernels_setters_change_the_process_default():
    from specserve.kernels import gemv_configs, pdl

    previous = set_default(pdl=True, stream_k=False)
    try:
        assert pdl.set_enabled(False) is True and not pdl.is_enabled()
        gemv_configs.set_stream_k(True)
        assert gemv_configs.stream_k_enabled() and current().stream_k
        with using(KernelOptions()):  # an engine's own options win inside its work
            assert pdl.is_enabled() and not gemv_configs.stream_k_enabled()
    finally:
        kernel_options._default = previous


def test_each_engine_runs_under_its_own_options(tiny_llama):
    plain = LLM(str(tiny_llama))
    no_pdl = LLM(str(tiny_llama), disable_pdl=True, gemv_stream_k=True)
    assert plain.engine.kernel_options == KernelOptions()
    assert no_pdl.engine.kernel_options == KernelOptions(pdl=False, stream_k=True)
    seen = []
    for llm in (plain, no_pdl, plain):
        loop = llm.engine.loop
        step = loop.step

        def spy(step=step):
            seen.append(current())
            return step()

        loop.step = spy
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        del loop.step  # the class's again (its bound method put back: a reference cycle)
    firsts = [seen.index(o) for o in (plain.engine.kernel_options, no_pdl.engine.kernel_options)]
    assert firsts[0] < firsts[1] and seen[-1] == KernelOptions()
    assert KernelOptions(pdl=False, stream_k=True) in seen
    assert current() == kernel_options._default  # nothing leaks out of a step
    # switches the config does not name: the process default's when the engine is built
    previous = set_default(argmax="off")
    try:
        assert LLM(str(tiny_llama)).engine.kernel_options.argmax == "off"
    finally:
        kernel_options._default = previous
