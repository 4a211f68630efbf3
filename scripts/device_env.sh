# Sourced by the device-check scripts: $OUT for the result files (the device tool's, or ./out),
# the carried wheels of .whl/ on PYTHONPATH (the device machine reaches no package index), and
# the project installed over the machine's own torch.
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
# SKIP_INSTALL=1: the project is installed already (CI's quick run keeps its non-editable install)
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
fi
