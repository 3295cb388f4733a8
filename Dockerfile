# The Airflow image of docker-compose.yaml: the official image plus this provider and its dependencies
# (apache-airflow-providers-google, apache-airflow-providers-ssh, google-cloud-compute, huggingface_hub).
FROM apache/airflow:3.3.2-python3.12

# The Google Cloud CLI, for the iap network path's tunnel (gcloud compute start-iap-tunnel), as Airflow's image
# recipe installs it (airflow.apache.org/docs/docker-stack/recipes.html, "Google Cloud SDK installation"): the
# release archive unpacked into GCLOUD_HOME, no components beyond the core. It needs no gcloud auth: the tunnel
# runs as the Airflow Google connection. CLOUD_SDK_VERSION pins a release (empty: the newest).
SHELL ["/bin/bash", "-o", "pipefail", "-e", "-u", "-x", "-c"]
USER 0
ARG CLOUD_SDK_VERSION=""
ENV GCLOUD_HOME=/opt/google-cloud-sdk
ENV PATH="${GCLOUD_HOME}/bin/:${PATH}"
RUN DOWNLOAD_URL="https://dl.google.com/dl/cloudsdk/channels/rapid/downloads/google-cloud-cli${CLOUD_SDK_VERSION:+-${CLOUD_SDK_VERSION}}-linux-x86_64.tar.gz" \
    && TMP_DIR="$(mktemp -d)" \
    && curl -fL "${DOWNLOAD_URL}" --output "${TMP_DIR}/google-cloud-cli.tar.gz" \
    && mkdir -p "${GCLOUD_HOME}" \
    && tar xzf "${TMP_DIR}/google-cloud-cli.tar.gz" -C "${GCLOUD_HOME}" --strip-components=1 \
    && "${GCLOUD_HOME}/install.sh" --bash-completion=false --path-update=false --usage-reporting=false --quiet \
    && rm -rf "${TMP_DIR}" "${GCLOUD_HOME}/.install/.backup/" \
    && gcloud --version

# The official image installs Python packages as the airflow user (into ~/.local); so does this one.
USER airflow
# What the wheel is built from: LICENSE is its license file, dags/ what its example_dags/ link to.
COPY --chown=airflow:0 pyproject.toml README.md LICENSE /opt/airflow/src/airflow-tpu-posttrain/
COPY --chown=airflow:0 dags/ /opt/airflow/src/airflow-tpu-posttrain/dags/
COPY --chown=airflow:0 airflow_tpu_posttrain/ /opt/airflow/src/airflow-tpu-posttrain/airflow_tpu_posttrain/
# Pinning apache-airflow to the image's version keeps pip from up- or downgrading Airflow itself while it
# resolves the provider's dependencies.
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" /opt/airflow/src/airflow-tpu-posttrain
