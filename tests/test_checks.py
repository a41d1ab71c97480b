"""The shared argument checks: one message naming the argument, the value and what is accepted."""
import math

import numpy as np
import pytest

from tfsparse import _checks


@pytest.mark.parametrize("value, kwargs, accepted", [
    (0.0, dict(lo=0.0, hi=1.0, lo_open=True), r"a number in \(0, 1\]"),
    (1.0, dict(lo=0.0, hi=1.0, hi_open=True), r"a number in \[0, 1\)"),
    (-1, dict(lo=0.0), r"a number in \[0, inf\)"),
    (2.5, dict(hi=2.0), r"a number in \(-inf, 2\]"),
    (math.nan, {}, r"a number in \(-inf, inf\)"),
    (math.inf, dict(lo=0.0), "a number"),
    (True, dict(lo=0.0), "a number"),
    ("0.5", dict(lo=0.0), "a number"),
])
def test_real_refuses_with_name_value_and_interval(value, kwargs, accepted):
    with pytest.raises(ValueError, match=rf"^x={value!r} is not valid; accepted: {accepted}"):
        _checks.real("x", value, **kwargs)


def test_real_returns_a_float_and_appends_the_hint():
    assert _checks.real("x", np.float32(0.5), 0.0, 1.0) == 0.5
    assert type(_checks.real("x", 1, 0.0)) is float
    with pytest.raises(ValueError, match=r"accepted: a number in \(0, inf\) \(bytes/s\)$"):
        _checks.real("beta", 0, 0.0, lo_open=True, hint=" (bytes/s)")


@pytest.mark.parametrize("value, kwargs, accepted", [
    (0, dict(minimum=1), "an integer >= 1"),
    (5, dict(minimum=0, maximum=4), r"an integer in \[0, 4\]"),
    (1.0, dict(minimum=0), "an integer >= 0"),
    (False, dict(minimum=0), "an integer >= 0"),
    (None, {}, "an integer"),
])
def test_integer_refuses_with_name_value_and_range(value, kwargs, accepted):
    with pytest.raises(ValueError, match=rf"^n={value!r} is not valid; accepted: {accepted}"):
        _checks.integer("n", value, **kwargs)


def test_integer_accepts_numpy_integers():
    got = _checks.integer("n", np.int64(3), 0, 3)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", ["c", ["a"], True, None, np.zeros(3), 1.0])
def test_choice_refuses_with_name_value_and_the_choices(value):
    with pytest.raises(ValueError) as info:
        _checks.choice("x", value, ("a", "b", 1))
    assert str(info.value) == f"x={value!r} is not supported; accepted: 'a', 'b', 1"
    with pytest.raises(ValueError, match=r"^x='c' is not supported; accepted: a or b$"):
        _checks.choice("x", "c", ("a", "b"), accepted="a or b")


def test_choice_returns_the_value_a_subclass_included():
    assert _checks.choice("x", np.str_("a"), ("a", "b")) == "a" and _checks.choice("x", None, ("a", None)) is None
    assert _checks.choice("x", 1, ("a", 1)) == 1


@pytest.mark.parametrize("bad", ["malloc", "BFC", True, 0])
def test_init_refuses_an_unknown_cpu_allocator_before_anything(bad):
    import tfsparse

    with pytest.raises(ValueError, match=r"cpu_allocator=.* is not supported; accepted: 'auto' \(TFSPARSE_SETUP\), 'bfc'"):
        tfsparse.init(cpu_allocator=bad)


@pytest.mark.parametrize("text,on", [
    (None, set()), ("none", set()), ("", set()), ("ALL", {"quiet_workers", "plain_output", "cores_per_rank",
                                                          "cpu_allocator", "thread_priority"}),
    (" quiet_workers , cpu_allocator", {"quiet_workers", "cpu_allocator"})])
def test_the_process_wide_changes_come_from_tfsparse_setup(monkeypatch, text, on):
    """init()'s "auto" switches: none under a bare launcher, all under tfsparse-run (which sets
    TFSPARSE_SETUP=all), or those named; an argument other than "auto" wins."""
    from tfsparse.run import build_command
    from tfsparse.runtime import _setup_from_environment, _switch

    if text is None:
        monkeypatch.delenv("TFSPARSE_SETUP", raising=False)
    else:
        monkeypatch.setenv("TFSPARSE_SETUP", text)
    setup = _setup_from_environment()
    assert setup == on
    assert _switch("quiet_workers", "auto", setup) == ("quiet_workers" in on)
    assert _switch("quiet_workers", True, frozenset()) and not _switch("quiet_workers", False, setup)
    monkeypatch.delenv("TFSPARSE_SETUP", raising=False)
    assert build_command(2, ["python3", "x.py"])[1]["TFSPARSE_SETUP"] == "all"


@pytest.mark.parametrize("kwargs,env,words", [
    ({"stall_warning": -1}, {}, "stall_warning=-1 is not valid; accepted: a number in (0, inf), None or 0 (off)"),
    ({"stall_timeout": "soon"}, {}, "stall_timeout='soon' is not valid"),
    ({"stall_timeout": True}, {}, "stall_timeout=True is not valid"),
    ({}, {"TFSPARSE_STALL_TIMEOUT": "ten"}, "TFSPARSE_STALL_TIMEOUT='ten' is not valid; accepted: a number of seconds"),
    ({}, {"TFSPARSE_STALL_WARNING": "-5"}, "TFSPARSE_STALL_WARNING='-5' is not valid"),
    ({"stall_stacks": "yes"}, {}, "stall_stacks='yes' is not supported; accepted: True, False or 'auto' (the "
     "environment variable TFSPARSE_STALL_STACKS)"),
    ({}, {"TFSPARSE_STALL_STACKS": "maybe"}, "TFSPARSE_STALL_STACKS='maybe' is not valid; accepted: 1, on, true"),
    ({"quiet_workers": "yes"}, {}, "quiet_workers='yes' is not supported; accepted: True, False or 'auto'"),
    ({"plain_output": 1}, {}, "plain_output=1 is not supported"),
    ({"thread_priority": None}, {}, "thread_priority=None is not supported"),
    ({"abort_on_error": "auto"}, {}, "abort_on_error='auto' is not supported; accepted: True or False"),
    ({"cores_per_rank": "half"}, {}, "cores_per_rank='half' is not supported; accepted: 'auto', 'share'"),
    ({}, {"TFSPARSE_SETUP": "quiet_workers,colours"}, "TFSPARSE_SETUP='quiet_workers,colours' names 'colours'; "
     "accepted: 'all', 'none', or names from quiet_workers, plain_output, cores_per_rank"),
])
def test_init_refuses_a_bad_setting_before_anything(monkeypatch, kwargs, env, words):
    import tfsparse

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as err:
        tfsparse.init(**kwargs)
    assert words in str(err.value)


def test_stall_settings_come_from_the_environment_when_auto(monkeypatch):
    from tfsparse.runtime import _stall_seconds

    assert _stall_seconds("stall_warning", "auto", "TFSPARSE_STALL_WARNING", 60.0) == 60.0
    monkeypatch.setenv("TFSPARSE_STALL_TIMEOUT", "90")
    assert _stall_seconds("stall_timeout", "auto", "TFSPARSE_STALL_TIMEOUT", None) == 90.0
    monkeypatch.setenv("TFSPARSE_STALL_TIMEOUT", "off")
    assert _stall_seconds("stall_timeout", "auto", "TFSPARSE_STALL_TIMEOUT", None) is None
    assert _stall_seconds("stall_timeout", 0, "TFSPARSE_STALL_TIMEOUT", None) is None
    assert _stall_seconds("stall_timeout", 30, "TFSPARSE_STALL_TIMEOUT", None) == 30.0


def test_stall_stacks_come_from_the_environment_when_auto_and_name_every_thread(monkeypatch):
    import threading

    from tfsparse.collectives.watchdog import thread_stacks
    from tfsparse.runtime import _stall_stacks

    monkeypatch.delenv("TFSPARSE_STALL_STACKS", raising=False)
    assert _stall_stacks("auto") is False and _stall_stacks(True) is True
    monkeypatch.setenv("TFSPARSE_STALL_STACKS", "On")
    assert _stall_stacks("auto") is True and _stall_stacks(False) is False
    monkeypatch.setenv("TFSPARSE_STALL_STACKS", "0")
    assert _stall_stacks("auto") is False

    waiting, parked = threading.Event(), threading.Event()

    def parked_here():
        parked.set()
        waiting.wait(30)

    other = threading.Thread(target=parked_here, name="parked")
    other.start()
    parked.wait(30)
    try:
        text = thread_stacks(3)
    finally:
        waiting.set()
        other.join()
    assert text.startswith("tfsparse: rank 3's threads at a stall inquiry (stall_stacks):\n")
    assert "  thread parked:\n" in text and "in parked_here\n" in text and "  thread MainThread:\n" in text
    assert "in test_stall_stacks_come_from_the_environment_when_auto_and_name_every_thread" in text


def test_one_registry_for_every_family_of_named_stages():
    from tfsparse._registry import Registry
    from tfsparse.compressors import ReusedThreshold, check_compressor, compressors_by_name

    reg = Registry("thing", "thing_kind")

    @reg.register("b")
    class B:
        pass

    @reg.register
    class A:
        name = "a"

    assert reg.names() == ("a", "b") and reg.get("b") is B and B.name == "b"
    with pytest.raises(ValueError, match=r"^thing_kind='c' is not supported; accepted: 'a', 'b'$"):
        reg.get("c")
    with pytest.raises(ValueError, match=r"^thing_kind='c' is not supported; accepted: 'a' or 'b'$"):
        reg.get("c", accepted="'a' or 'b'")
    with pytest.raises(ValueError, match="thing 'a' is registered twice"):
        reg.register(A)
    ordered = Registry("wire", "wire_dtype", ordered=True, make=lambda cls: cls())
    ordered.register(B)
    ordered.register(A)
    assert ordered.names() == ("b", "a") and isinstance(ordered.get("a"), A)
    # every compressor is registered, Ok-Topk's reused threshold too; compressor= names only those
    # that work under any aggregator (Ok-Topk's threshold is re-evaluated by its own aggregator alone)
    from tfsparse.compressors import COMPRESSORS

    assert COMPRESSORS.get("oktopk") is ReusedThreshold and "oktopk" not in compressors_by_name()
    assert sorted(compressors_by_name()) == ["dgc", "dragonn", "gaussiank", "identity", "topk"]
    with pytest.raises(ValueError, match="compressor='oktopk' is not supported"):
        check_compressor("oktopk")


@pytest.mark.parametrize("module,function,aborts", [
    ("__main__", "<module>", True), ("runpy", "_run_module_as_main", True), ("_pytest.python", "<module>", False),
    ("__main__", "callback", False)])
def test_only_an_exception_that_ends_the_program_aborts_the_job_at_exit(monkeypatch, module, function, aborts):
    """init()'s abort at exit reads the uncaught exception Python leaves in sys.last_value --
    only where its traceback starts at the program's top level (a script's module code, python
    -m's runner): pytest, an interactive or IPython session, or C code reporting a callback's
    error leave one there for errors they handled."""
    import sys

    from tfsparse.runtime import _uncaught_exception

    body = "try:\n    raise RuntimeError('x')\nexcept RuntimeError as e:\n    caught = e\n"
    scope = {"__name__": module}
    if function == "<module>":
        exec(body, scope)
    else:  # the outermost frame is a function's of that name
        exec(f"def {function}():\n" + "".join(f"    {line}\n" for line in body.splitlines()) + "    return caught\n",
             scope)
        scope["caught"] = scope[function]()
    exc = scope["caught"]
    monkeypatch.setattr(sys, "last_value", exc, raising=False)
    monkeypatch.setattr(sys, "last_traceback", exc.__traceback__, raising=False)
    assert (_uncaught_exception() is exc) == aborts
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # an interactive session: never
    assert _uncaught_exception() is None
    monkeypatch.delattr(sys, "ps1")
    monkeypatch.setattr(sys, "last_value", None)
    assert _uncaught_exception() is None
