/*-------------------------------------------------------------------------
 *
 * shmem.h
 *	  idem's shared memory (shmem.c): the request and startup hooks that
 *	  size and initialise every area, installed from _PG_init when idem is
 *	  in shared_preload_libraries.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SHMEM_H
#define IDEM_SHMEM_H

extern void idem_shmem_register(void);

#endif							/* IDEM_SHMEM_H */
