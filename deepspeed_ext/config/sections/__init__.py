"""One typed model per DeepSpeed config section (one module each), named by upstream's keys."""
