"""The tools built on the transforms: `compare_donation`, `donation_report`, the pytest fixture's body (see README.md)."""
