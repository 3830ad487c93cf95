"""The fenced sink: a partition owner's writes applied once and in key order, refused from
an owner that lost the partition; its audit, schema and a ready-made running-totals writer.

Builds on :mod:`..stream`.
"""
