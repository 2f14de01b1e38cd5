//! Graph passes: canonicalisation.
