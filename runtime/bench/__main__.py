"""`python -m runtime.bench --json-schema > docs/result.schema.json`: the result file's JSON Schema."""

import json
import sys

from runtime.bench.schema import json_schema

if sys.argv[1:] != ["--json-schema"]:
    sys.exit("usage: python -m runtime.bench --json-schema > docs/result.schema.json")
print(json.dumps(json_schema(), indent=2))
