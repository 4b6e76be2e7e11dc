-- Run once by the postgres image on an empty data volume (docker-entrypoint-initdb.d):
-- Prefect uses the database POSTGRES_DB (prefect); MLflow gets its own, since both keep an
-- alembic_version table.
CREATE DATABASE mlflow;
