"""Training: the EAGLE / LANTERN drafter trainer shared by `runtime train drafter` and the demo's
training (`drafter_training`)."""
