"""The row store: a shard's rows that do not fit its memory, with their optimizer state, in files on local disk.

``stores.RowStores`` is a shard's store (its folder under ``--row-store``, its
tiers, ``--row-memory`` shared by its tables); ``tier.StoreTier`` one table
part's rows on disk (writes, reads, reads ahead, scans); ``layout`` how a row,
its last touch and its optimizer state make one record; ``latency`` its reads'
times.  ``engine`` says what an engine is (records of one size keyed by int64
ids, in files under one folder); ``row_log`` is the log-structured engine of
our own (C, ``row_log.c``); ``rocks`` keeps the records in RocksDB
(rocksdict).  The dynamic tables (``..dynamic.rows``) decide which rows are in
memory and call their tier.
"""
