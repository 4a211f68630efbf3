"""The embedded demo: a procedural image dataset and the small models trained on it.

`runtime.demo.bundle.load_demo_bundle()` loads the packaged bundle (target GPT, VQ tokenizer,
drafter, quality classifier); `runtime train demo` rebuilds it (`runtime.demo.train`).
"""
