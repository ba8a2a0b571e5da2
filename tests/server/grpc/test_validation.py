"""Request validation, unit by unit: each refusal is INVALID_ARGUMENT and names the field,
the limit and the setting behind it; valid fields come back as the pod's JSON wants them."""

from __future__ import annotations

import math

import grpc
import pytest

from prefix_sidecar.abort import RpcAbort
from prefix_sidecar.server.grpc.validation import (
    CHAT_ROLES,
    MAX_REPLICAS,
    MAX_STOP,
    chat_messages,
    registration_text,
    sampling_params,
    text_field,
)
from prefix_sidecar.v1 import router_pb2


def refusal(call: object) -> str:
    """The message of the INVALID_ARGUMENT a validation call raised."""
    assert callable(call)
    with pytest.raises(RpcAbort) as raised:
        call()
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return raised.value.message


# --- text_field -----------------------------------------------------------------------------


def test_a_text_within_its_limit_is_returned_unchanged() -> None:
    assert text_field("héllo", "input", 6) == "héllo"  # 6 UTF-8 bytes
    assert text_field("", "input", 0) == ""


def test_a_text_over_its_limit_names_its_size_the_limit_and_the_setting() -> None:
    message = refusal(lambda: text_field("é" * 4, "input", 7))
    assert message == "input is 8 bytes; the maximum is 7 bytes (config max_input_bytes)"
    assert "max_prefix_bytes" in refusal(lambda: text_field("x" * 9, "prefix_text", 8))
    assert "(a fixed limit)" in refusal(lambda: text_field("x" * 9, "stop", 8, "a fixed limit"))


def test_a_lone_surrogate_is_refused_with_its_position() -> None:
    message = refusal(lambda: text_field("ok\ud800", "input", 100))
    assert "not valid UTF-8" in message and "character 2" in message


# --- registration_text ----------------------------------------------------------------------


def test_registration_checks_name_replicas_and_text() -> None:
    def register(**fields: object) -> str:
        request = router_pb2.RegisterPrefixRequest(**fields)  # type: ignore[arg-type]
        return registration_text(request, max_prefix_bytes=10)

    assert register(name="rules", text="0123456789", replicas=MAX_REPLICAS) == "0123456789"
    assert "name is empty" in refusal(lambda: register(text="t"))
    assert f"the maximum is {MAX_REPLICAS}" in refusal(
        lambda: register(name="r", text="t", replicas=MAX_REPLICAS + 1)
    )
    assert "prefix text is 11 bytes" in refusal(lambda: register(name="r", text="x" * 11))


# --- sampling_params ------------------------------------------------------------------------


def test_only_the_sampling_fields_set_are_sent() -> None:
    assert sampling_params(router_pb2.CompleteRequest(input="q")) == {}
    request = router_pb2.CompleteRequest(
        max_tokens=7, temperature=0.0, top_p=1.0, stop=["\n", "END"], seed=0
    )
    assert sampling_params(request) == {
        "max_tokens": 7,
        "temperature": 0.0,
        "top_p": 1.0,
        "stop": ["\n", "END"],
        "seed": 0,
    }


@pytest.mark.parametrize("temperature", [-0.1, math.inf, math.nan])
def test_a_temperature_that_is_negative_or_not_finite_is_refused(temperature: float) -> None:
    request = router_pb2.ChatRequest(temperature=temperature)
    assert "temperature" in refusal(lambda: sampling_params(request))


@pytest.mark.parametrize("top_p", [0.0, 1.5, -1.0])
def test_a_top_p_outside_zero_to_one_is_refused(top_p: float) -> None:
    request = router_pb2.CompleteRequest(top_p=top_p)
    assert "top_p" in refusal(lambda: sampling_params(request))


@pytest.mark.parametrize(
    "stop", [["a"] * (MAX_STOP + 1), ["a", ""], ["x" * 1025]], ids=["many", "empty", "long"]
)
def test_stop_strings_are_bounded_in_number_and_size(stop: list[str]) -> None:
    request = router_pb2.CompleteRequest(stop=stop)
    assert "stop" in refusal(lambda: sampling_params(request))


# --- chat_messages --------------------------------------------------------------------------


def message(role: str, content: str) -> router_pb2.ChatMessage:
    return router_pb2.ChatMessage(role=role, content=content)


def test_chat_messages_keep_their_order_role_and_content() -> None:
    messages = [message(role, f"{role} says") for role in CHAT_ROLES]
    assert chat_messages(messages, 1000) == [
        {"role": role, "content": f"{role} says"} for role in CHAT_ROLES
    ]
    assert chat_messages([], 10) == []


def test_an_unknown_role_is_refused_naming_the_roles_and_clipping_the_callers_words() -> None:
    text = refusal(lambda: chat_messages([message("user", "hi"), message("robot", "")], 100))
    assert "messages[1].role is 'robot'" in text and "user" in text
    huge = refusal(lambda: chat_messages([message("r" * 100_000, "")], 100))
    assert len(huge) < 200, "a caller's role must not fill the status message"


def test_chat_messages_are_bounded_each_and_in_total() -> None:
    assert "messages[0].content is 11 bytes" in refusal(
        lambda: chat_messages([message("user", "x" * 11)], 10)
    )
    assert "messages hold 12 bytes; the maximum is 10 bytes" in refusal(
        lambda: chat_messages([message("user", "x" * 6), message("user", "y" * 6)], 10)
    )
