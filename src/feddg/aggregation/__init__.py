"""Pure aggregation functions on arrays: no models, no federation state."""
