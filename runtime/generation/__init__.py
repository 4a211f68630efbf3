"""The generation layer: what every command, the server and Python users share once they name a
model: loading it (`loading`), resolving its settings once (`settings`), the decoder and timed
generation (`pipeline`), the backend and profile (`device_setup`), the chunked sample store
(`sample_store`), and the public `ImageGenerator` over them (`generator`)."""
