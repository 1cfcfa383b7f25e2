"""The target service: the big model; verifies draft trees and owns the KV cache."""
