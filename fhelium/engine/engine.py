"""CkksEngine: RNS-CKKS arithmetic on pure torch tensors.

State is explicit: operations check their operands' depth, scale, domain and primes and never
insert hidden rescales or domain changes. Ciphertexts are kept in the NTT domain by default
(``encrypt`` output), where add and multiply are pointwise; rescale and key switching do their
own internal transforms. Residues are always in the standard form ``[0, q)``.

``CkksEngine`` is the facade: its state (parameters, tables, caches, operand checks) is
``EngineBase`` (base.py), and each operation is a plain function of the engine in the module of its
capability, bound here as a method under its public name:

- ``keygen.py``: secret, public, relinearization, rotation and conjugation keys;
- ``encryption.py``: encode/decode, encryption (public-key, integer, symmetric, seeded), decryption;
- ``keyswitch.py``: digit decomposition and key switching: relinearize, rotate, conjugate;
- ``evaluation.py``: add/sub/negate/sum, plaintext operations, multiply, rescale, mod switch, domains;
- ``kernels.py``: the RNS kernels they share (small-integer NTT, ModDown, CRT reconstruction).

Those modules type their engine parameter as ``EngineOperations`` (operations.py: ``EngineBase`` and
the signatures of the operations they call through it), never as ``CkksEngine``, so none of them
imports this module.

The functions call each other through the engine (``engine.encrypt(...)``), so a subclass that
overrides a method is seen by every operation that uses it, as when they were methods.
"""

from __future__ import annotations

from fhelium.engine import encryption, evaluation, kernels, keygen, keyswitch
from fhelium.engine.operations import EngineOperations


class CkksEngine(EngineOperations):
    """Keys, encoding, encryption and homomorphic operations for one parameter set."""

    # ------------------------------------------------------------ keys (keygen.py)
    generate_secret_key = keygen.generate_secret_key
    generate_public_key = keygen.generate_public_key
    generate_relinearization_key = keygen.generate_relinearization_key
    generate_rotation_key = keygen.generate_rotation_key
    generate_conjugation_key = keygen.generate_conjugation_key
    generate_keys = keygen.generate_keys
    _check_secret = keygen.check_secret
    _error_ntt = keygen.error_ntt
    _key_switch_key_data = keygen.key_switch_key_data

    # ------------------------------------------------------------ encode / decode (encryption.py)
    encode = encryption.encode
    decode = encryption.decode

    # ------------------------------------------------------------ encrypt / decrypt (encryption.py)
    encrypt = encryption.encrypt
    encrypt_integers = encryption.encrypt_integers
    encode_encrypt = encryption.encode_encrypt
    encrypt_symmetric = encryption.encrypt_symmetric
    encrypt_seeded = encryption.encrypt_seeded
    expand_seeded = encryption.expand_seeded
    uniform_from_seed = encryption.uniform_from_seed
    decrypt = encryption.decrypt
    decrypt_decode = encryption.decrypt_decode

    # ------------------------------------------------------------ additive operations (evaluation.py)
    add = evaluation.add
    add_ = evaluation.add_
    sub = evaluation.sub
    sub_ = evaluation.sub_
    negate = evaluation.negate
    negate_ = evaluation.negate_
    sum = evaluation.sum
    sum_batch = evaluation.sum_batch

    # ------------------------------------------------------------ plaintext operations (evaluation.py)
    add_plain = evaluation.add_plain
    sub_plain = evaluation.sub_plain
    multiply_plain = evaluation.multiply_plain
    _with_plain_in_c0 = evaluation.with_plain_in_c0

    # ------------------------------------------------------------ multiplication, levels (evaluation.py)
    multiply = evaluation.multiply
    square = evaluation.square
    rescale = evaluation.rescale
    mod_switch = evaluation.mod_switch
    mod_switch_plain = evaluation.mod_switch_plain

    # ------------------------------------------------------------ domains (evaluation.py)
    to_ntt = evaluation.to_ntt
    to_coefficient = evaluation.to_coefficient

    # ------------------------------------------------------------ key switching (keyswitch.py)
    relinearize = keyswitch.relinearize
    rotate = keyswitch.rotate
    rotate_many = keyswitch.rotate_many
    rotate_by_step = keyswitch.rotate_by_step
    conjugate = keyswitch.conjugate
    _check_switch_key = keyswitch.check_switch_key
    _decompose = keyswitch.decompose
    _inner_product = keyswitch.inner_product
    _key_switch = keyswitch.key_switch
    _galois_switch = keyswitch.galois_switch

    # ------------------------------------------------------------ shared RNS kernels (kernels.py)
    _small_ntt = kernels.small_ntt
    _reconstruct = kernels.reconstruct
    _mod_down = kernels.mod_down
    _inverse_constants = kernels.inverse_constants


__all__ = ["CkksEngine"]
