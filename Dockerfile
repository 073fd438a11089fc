# One image for the API, the workers and Flower. TORCH_SPEC picks the torch build (CPU by default).
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      tesseract-ocr tesseract-ocr-eng tesseract-ocr-chi-sim curl \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 stoker
WORKDIR /app

RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" ${TORCH_SPEC}
# Celery's configuration is the top-level celeryconfig.py, installed as a module of its own.
COPY pyproject.toml README.md celeryconfig.py ./
COPY stoker ./stoker
COPY api ./api
COPY tasks ./tasks
COPY workers ./workers
RUN pip install --no-cache-dir .

# Bake the built-in model into the image: no download at run time.
ENV STOKER_MODEL_CACHE=/models \
    TOKENIZERS_PARALLELISM=false
RUN stoker model fetch && chown -R stoker /models
# Batch files (`STOKER_FILES_DIR`): a volume mounted here keeps this directory's owner.
RUN mkdir -p /var/lib/stoker/files && chown stoker /var/lib/stoker/files

USER stoker
# 8000: the API; 5555: Flower; 9105: the API's metrics (bound per STOKER_METRICS_HOST).
EXPOSE 8000 5555 9105
CMD ["stoker", "api", "--host", "0.0.0.0", "--port", "8000"]
