# Source on the GPU machine: installs the carried wheels (.whl/) into /tmp/site and puts the
# repository on PYTHONPATH. The device image has torch, triton and transformers already.
# .whl/ is not tracked (git's info/exclude); fill it on the CPU machine before the first run:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     gguf fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn \
#     openai jiter distro sniffio llguidance jsonschema jsonschema-specifications referencing \
#     rpds-py opentelemetry-api httpx2 httpcore2 truststore typing-extensions pytest-xdist execnet
# (about 10 MB; the device tool carries it with carry=[".whl"]).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
