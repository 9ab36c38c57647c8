"""The collector's pause while a model is built: nested and concurrent pauses count, and collection comes back
only if it was on before the first."""

from __future__ import annotations

import gc
import threading

from kvscope.core.base.longlived import collector_paused


def test_pauses_nest_and_collection_resumes_after_the_last():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()


def test_a_pause_on_another_thread_keeps_collection_off_until_both_end():
    inside, release = threading.Event(), threading.Event()

    def other():
        with collector_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    with collector_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause is still on
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_collection_off_before_stays_off():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_still_resumes_collection():
    try:
        with collector_paused():
            raise ValueError("a load that failed")
    except ValueError:
        pass
    assert gc.isenabled()
