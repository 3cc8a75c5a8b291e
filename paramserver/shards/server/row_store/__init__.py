"""The row store: a shard's rows that do not fit its memory, with their optimizer state, in files on local disk.

``engine`` says what an engine is (records of one size keyed by int64 ids,
in files under one folder) and which one a store uses; ``row_log`` is the
log-structured engine of our own (C, ``row_log.c``); ``rocks`` keeps the
records in RocksDB (rocksdict).
"""
