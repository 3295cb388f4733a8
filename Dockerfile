# The Airflow image of docker-compose.yaml: the official image plus this provider and its dependencies
# (apache-airflow-providers-google, apache-airflow-providers-ssh, google-cloud-compute, huggingface_hub).
FROM apache/airflow:3.3.2-python3.12

# The official image installs Python packages as the airflow user (into ~/.local); so does this one.
USER airflow
# What the wheel is built from: LICENSE is its license file, dags/ what its example_dags/ link to.
COPY --chown=airflow:0 pyproject.toml README.md LICENSE /opt/airflow/src/airflow-tpu-posttrain/
COPY --chown=airflow:0 dags/ /opt/airflow/src/airflow-tpu-posttrain/dags/
COPY --chown=airflow:0 airflow_tpu_posttrain/ /opt/airflow/src/airflow-tpu-posttrain/airflow_tpu_posttrain/
# Pinning apache-airflow to the image's version keeps pip from up- or downgrading Airflow itself while it
# resolves the provider's dependencies.
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" /opt/airflow/src/airflow-tpu-posttrain
