"""The bulk API suites run against a node in the test process where the transport is not what they test; a
test that needs a real process asks for the session's ``server`` and gets its clients (:mod:`support.fixtures`)."""

from support.fixtures import (  # noqa: F401  (fixtures)
    bucket,
    inprocess,
    inprocess_s3,
    inprocess_s3_other,
    real_s3,
    real_s3_other,
    s3,
    s3_other,
)
