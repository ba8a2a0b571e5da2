"""The metrics' label sweeps (prefix_sidecar/metrics.py): series of pods that left and of names no
longer registered go (issue 11 item 9)."""

from __future__ import annotations

from prefix_sidecar.metrics import FRONT_GRPC, FRONT_HTTP, Metrics

# --- Metrics: series of pods that left, names no longer registered --------------------------


def series(metrics: Metrics, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(sample.labels.values()): sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    }


def test_a_departed_pods_in_flight_never_goes_negative_and_then_goes() -> None:
    metrics = Metrics()
    members = {"http://old", "http://new"}
    metrics.track(lambda url: url in members, lambda name: False)
    metrics.child(metrics.in_flight, FRONT_GRPC, "http://old").inc()  # a stream starts on it
    metrics.child(metrics.ttft, FRONT_GRPC, "http://old").observe(0.1)
    metrics.set_backend("http://old", "serving", True)

    members.discard("http://old")
    metrics.forget_backends()
    assert series(metrics, "prefix_sidecar_in_flight") == {("grpc", "http://old"): 1.0}
    assert series(metrics, "prefix_sidecar_backend_healthy") == {}
    assert series(metrics, "prefix_sidecar_ttft_seconds_count") == {}

    metrics.child(metrics.in_flight, FRONT_GRPC, "http://old").dec()  # the stream ends
    metrics.child(
        metrics.requests, FRONT_GRPC, "Complete", "default", "http://old", "home", "OK"
    ).inc()
    assert series(metrics, "prefix_sidecar_in_flight") == {("grpc", "http://old"): 0.0}
    assert b"http://old" not in metrics.render()
    assert not metrics._children  # the memo forgot them too


def test_both_fronts_series_of_a_departed_pod_go_and_no_backend_stays() -> None:
    """requests and ttft carry `front` before `backend`: the sweep still finds the pod."""
    metrics = Metrics()
    members = {"http://old", "http://new"}
    metrics.track(lambda url: url in members, lambda name: False)
    for front, rpc in ((FRONT_GRPC, "Complete"), (FRONT_HTTP, "http_completions")):
        for url in ("http://old", "http://new", "-"):
            metrics.child(metrics.requests, front, rpc, "default", url, "home", "OK").inc()
        for url in ("http://old", "http://new"):
            metrics.child(metrics.ttft, front, url).observe(0.1)
        metrics.child(metrics.decision, front, rpc).observe(1e-6)

    members.discard("http://old")
    metrics.forget_backends()
    assert set(series(metrics, "prefix_sidecar_requests_total")) == {
        (front, rpc, "default", url, "home", "OK")
        for front, rpc in (("grpc", "Complete"), ("http", "http_completions"))
        for url in ("http://new", "-")
    }
    assert set(series(metrics, "prefix_sidecar_ttft_seconds_count")) == {
        ("grpc", "http://new"),
        ("http", "http://new"),
    }
    assert set(series(metrics, "prefix_sidecar_decision_seconds_count")) == {
        ("grpc", "Complete"),
        ("http", "http_completions"),
    }
    assert b"http://old" not in metrics.render()


def test_usage_series_go_with_their_name() -> None:
    metrics = Metrics()
    registered = {"a", "b"}
    metrics.track(lambda url: True, lambda name: name in registered)
    for name in ("a", "b", "-"):
        metrics.record_usage(name, 10, 5, 1)
    registered.discard("a")
    metrics.forget_prefix("a")
    assert set(series(metrics, "prefix_sidecar_prompt_tokens_total")) == {("b",), ("-",)}
    metrics.record_usage("a", 10, 5, 1)  # a stream that was running when "a" went
    assert b'prefix="a"' not in metrics.render()
    assert b'prefix="b"' in metrics.render()
