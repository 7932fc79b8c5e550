"""One epoch's batches on their way to the trainer: batching, fetch threads, epoch iterators, device copy, metrics."""
