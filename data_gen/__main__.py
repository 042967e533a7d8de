"""``python -m data_gen --config FILE.yaml [--field value ...]`` (also under accelerate)."""

import sys

from cospec.errors import CoSpecError
from data_gen.main import main

try:
    main(sys.argv[1:])
except CoSpecError as err:
    print(f"cospec data-gen: error: {err}", file=sys.stderr)
    sys.exit(2)
