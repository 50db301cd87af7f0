"""``python -m ironloop``: what torchrun launches."""

import os
import sys

from ironloop.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # Under torchrun, skip the interpreter's teardown: gloo's and the TCPStore's C++ threads are
    # destroyed there, and now and then abort a rank that already finished ("terminate called
    # without an active exception", exit -6). fit() has closed every output and destroyed its
    # process group by now; flush what Python buffers and leave with the command's exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
