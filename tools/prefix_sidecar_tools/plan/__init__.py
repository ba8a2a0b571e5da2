"""`prefix-sidecar plan`: GPUs, TTFT and yuan/day for a traffic scenario (docs/plan.md)."""
