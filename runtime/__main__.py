"""`python -m runtime ...` (also what `torchrun -m runtime` runs).

Under a launcher (WORLD_SIZE > 1) the process leaves with `os._exit` once the command has
returned or exited, its output flushed: at interpreter teardown after a gloo process group, a
rank sometimes aborted ("terminate called without an active exception", exit -6, about 1 run in
10 of `torchrun --nproc-per-node 2 -m runtime train drafter` on the CPU) after everything was
written, and the launcher then reported the whole run as failed. The exit code is the command's.
"""

import logging
import os
import sys

from runtime.cli.app import main

if int(os.environ.get("WORLD_SIZE", "1") or "1") > 1:
    try:
        main()
        code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    logging.shutdown()  # what the skipped atexit would have flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
else:
    main()
