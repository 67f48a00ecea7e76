"""Pure logic: parsing, the host model, diffing and switch planning. No I/O lives here."""
