"""Utilities with no knowledge of models or methods: the one-line `UserError` (`errors`), atomic
writes (`atomic`), log lines (`log_format`), cache folders (`cache_dirs`), and torchrun process
groups (`distributed`)."""
