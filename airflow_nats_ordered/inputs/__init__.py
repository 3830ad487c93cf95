"""Reading records to publish: files, their order, record fields."""
