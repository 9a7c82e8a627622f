# Source on the GPU machine: installs the carried wheels (.whl/) into /tmp/site and puts the
# repository on PYTHONPATH. The device image has torch, triton and transformers already.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
