"""One error record shape, one class per code, one code → gRPC status table (fxport/errors.py)."""

from __future__ import annotations

import inspect

import grpc
import pytest

import fxport.errors as errors
from fxport.errors import ErrorRecord, FxportError, SpecError, error_class


def _module_classes() -> list[type[FxportError]]:
    return [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
            if issubclass(cls, FxportError) and cls.__module__ == errors.__name__]


def test_every_code_of_the_module_has_one_class_and_a_status():
    own = [cls for cls in _module_classes() if "code" in cls.__dict__]
    codes = [cls.code for cls in own]
    assert len(codes) == len(set(codes)), f"two classes share a code: {sorted(codes)}"
    for cls in own:
        assert error_class(cls.code) is cls or cls is FxportError
        assert cls.code in errors.GRPC_STATUS, f"{cls.__name__} ({cls.code}) answers no status of its own"
        assert errors.GRPC_STATUS[cls.code] in grpc.StatusCode.__members__


@pytest.mark.parametrize("cls", [c for c in _module_classes() if c is not SpecError], ids=lambda c: c.__name__)
def test_a_record_turns_back_into_its_class(cls):
    err = cls("it broke", stage="export", hint="do this", field="inputs[0]", detail="trace")
    back = FxportError.from_record(ErrorRecord.model_validate(err.to_dict()))
    assert type(back) is cls
    assert str(back) == "it broke — do this"
    assert (back.stage, back.field, back.detail) == ("export", "inputs[0]", "trace")


def test_a_spec_error_keeps_its_text_through_its_record():
    err = SpecError([("inputs[0].shape", "expected a list"), ("targets[1]", "unknown target")])
    back = FxportError.from_record(err.record())
    assert isinstance(back, SpecError)
    assert str(back) == str(err) and back.field == "inputs[0].shape"


def test_an_unknown_or_missing_code_is_the_class_asked_with():
    conversion = errors.ConversionFailed
    assert type(conversion.from_record(ErrorRecord(code="no_such_code", message="x"))) is conversion
    assert type(conversion.from_record(ErrorRecord(message="x"))) is conversion
    assert type(FxportError.from_record(ErrorRecord(code="no_such_code", message="x"))) is FxportError


def test_the_record_drops_control_characters_and_unknown_keys():
    rec = ErrorRecord.model_validate({"code": "capture_failed", "message": "a\x1b[31mred\x07", "extra": 1})
    assert "\x1b" not in rec.message and "\x07" not in rec.message
    assert not hasattr(rec, "extra") and "extra" not in rec.model_dump()


def test_child_errors_of_every_class_cross_the_sandbox_boundary_as_themselves():
    from fxport.workers.sandbox.run import _child_error

    for cls in (errors.SandboxViolation, errors.JobCancelled, errors.SpecError, errors.ResourceLimitExceeded):
        rec = _child_error({"code": cls.code, "message": "m", "stage": "load"})
        assert type(errors.ConversionFailed.from_record(rec)) is cls
    hostile = _child_error({"code": 7, "message": ["not", "text"], "detail": "x" * 10_000})
    assert type(errors.ConversionFailed.from_record(hostile)) is errors.ConversionFailed
    assert str(errors.ConversionFailed.from_record(hostile)) == "conversion failed"
    long = _child_error({"code": "capture_failed", "message": "m" * 10_000, "detail": "d" * 10_000})
    assert len(long.message) == 4000 and long.detail is not None and len(long.detail) == 4000
