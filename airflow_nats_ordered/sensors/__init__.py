"""Airflow sensor: NatsGroupDrainSensor waits until a group has processed a run."""
