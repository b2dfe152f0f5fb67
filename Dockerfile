# The fine-tuning GUI (`python -m app`) in a container; also what the Hugging Face Docker Space runs.
#   docker build -t finetune .                                        CPU image (the default)
#   docker build -t finetune-gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --rm --stop-timeout 120 -p 7860:7860 -v finetune-runs:/home/user/runs finetune   (GPU: --gpus all)
# `docker stop` sends SIGTERM: the app stops the run after its optimizer step, waits up to --stop-grace (60 s) for
# the checkpoint, then exits. Docker kills the container 10 s after SIGTERM unless told otherwise: --stop-timeout 120
# on `docker run` (or `docker stop -t 120`) gives the checkpoint time to be written.
FROM python:3.12-slim

ARG TORCH_VERSION=2.13.0
# CPU wheels unless told otherwise: PyPI's default Linux torch would put gigabytes of CUDA libraries into an image
# that has no GPU to use them. For a GPU image pass the CUDA wheel index that matches the host's driver.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# CMAKE_ARGS: `pip install "finetune[export]"` in this image (or one built from it) compiles llama.cpp for any x86-64
# processor, not for the build machine's (a Space runs the image on other hardware; docs/export.md).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"

# torch first, in its own layer: `pip install .` below then finds `torch>=2.6` satisfied and keeps this build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# Hugging Face Spaces runs the container as uid 1000; everything it writes goes under that user's home. Gradio's
# temporary files live in the runs volume, so that an upload is moved (not copied) into runs/uploads.
RUN useradd --create-home --uid 1000 user
WORKDIR /app
COPY pyproject.toml README.md ./
COPY finetune ./finetune
COPY app ./app
# The seq2seq extra: task=seq2seq scores its evaluation's generations with sacrebleu and rouge-score (small, pure
# Python), and a run in the container should not stop at its first evaluation for want of them.
RUN pip install ".[seq2seq]" && chown user /app
# The sample data and the preset the form opens with (the bundled model on SST-2 sentences).
COPY assets ./assets

USER user
ENV HOME=/home/user \
    HF_HOME=/home/user/.cache/huggingface \
    GRADIO_TEMP_DIR=/home/user/runs/.gradio \
    MPLCONFIGDIR=/home/user/.cache/matplotlib \
    FINETUNE_RUNS_DIR=/home/user/runs \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False
RUN mkdir -p "$HF_HOME" "$GRADIO_TEMP_DIR" "$MPLCONFIGDIR" "$FINETUNE_RUNS_DIR"

EXPOSE 7860
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/', timeout=5)"]
CMD ["python", "-m", "app"]
