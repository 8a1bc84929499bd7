# kvcdn serve in a container: the server extra plus the model families the operator chooses.
#
#   docker build -t kvcdn-server --build-arg FAMILIES="qwen,llama" .
#   docker run -p 8080:8080 -v kvcdn-data:/data -e KVCDN_ADMIN_SECRET=... kvcdn-server
#
# Builds from the wheels that scripts/build-release.sh writes to dist/ (run it first).
FROM python:3.11-slim

ARG FAMILIES=qwen
ARG TORCH_VERSION=2.13.0
# Extra pip arguments for torch, e.g. "--index-url <your CPU-only torch wheel index>": the default
# torch wheel for Linux is a CUDA build of several GB.
ARG TORCH_PIP_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 \
    XDG_DATA_HOME=/data HF_HOME=/data/hf

COPY dist/ /tmp/dist/
# torch pinned first: an unpinned torch could pull another (CUDA) build.
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_PIP_ARGS} \
 && pip install --find-links /tmp/dist "kvcdn[server,s3,${FAMILIES}]" \
 && rm -rf /tmp/dist

RUN useradd --system --uid 10001 --home-dir /data --create-home kvcdn
USER kvcdn
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8080

HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4).status == 200 else 1)"

# Inside a container the published port must be reachable, so bind all interfaces explicitly.
CMD ["kvcdn", "serve", "--host", "0.0.0.0", "--port", "8080"]
